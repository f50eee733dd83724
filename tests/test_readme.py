"""The README's commands, exactly as written: CI's .ci/run installs with the README's set-up command
into a fresh virtual environment, and this test runs the README's quick-start block in a shell."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _blocks(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def test_ci_runs_the_readme_setup_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _blocks("Set up")[0].strip()
    test = _blocks("Test")[0].strip()
    assert setup in ci and test in ci.splitlines()[-1]


def test_readme_quick_start_serves_and_stops(tmp_path):
    script = _blocks("Run")[0]
    bindir = str(Path(sys.executable).parent)  # the environment the README's set-up installed into
    env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp_path), "PATH": bindir + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the README's curl samples (OpenAI's default temperature 1, no seed): 16 tokens ending by length,
    # or 1 to 16 ending by stop when the model's stop token was drawn (one CI run drew it as the 5th
    # token, another as the 16th: it counts among the 16, and the finish reason is then stop)
    body = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.index('{"id"'):])[0]
    assert body["object"] == "text_completion", proc.stdout
    n, finish = body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
    assert (n, finish) == (16, "length") or (1 <= n <= 16 and finish == "stop"), proc.stdout
    assert "attention[0]" in proc.stdout and "expert[0]" in proc.stdout  # moeray status
    assert "stopped moeray" in proc.stderr
    assert not (tmp_path / "up.json").exists()
