"""The documented response models match what the builders produce, and the documented request
schemas accept what the routes accept (no Ray: the builders and models only)."""

import pytest

from actors.messages import SampledToken
from deploy import openai_responses as out
from deploy.ingress import Ingress
from deploy.openai_api import (chat_chunk, chat_response, completion_chunk, completion_response, error_body,
                               models_response, usage, usage_chunk)
from deploy.openai_models import ChatCompletionRequest
from deploy.output import ChoiceResult, chat_logprobs, completion_logprobs
from deploy.routes import make_api
from model.tokenizer import Tokenizer


api, doc = make_api(lambda name: getattr(Ingress, name))


@pytest.fixture(scope="module")
def tok():
    from model.tokenizer import SHIPPED_DIR
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


def test_builders_produce_the_documented_responses(tok):
    lp = [SampledToken(0, 5, -0.5, ((5, -0.5), (7, -1.5)))]
    for shape, response, schema in ((completion_logprobs, completion_response, out.CompletionResponse),
                                    (chat_logprobs, chat_response, out.ChatCompletionResponse)):
        choices = [ChoiceResult(0, "hi", [5], "length", shape(lp, tok)), ChoiceResult(1, "yo", [6], "stop")]
        schema.model_validate(response("m", choices, usage(3, 2)))
    out.CompletionResponse.model_validate(completion_chunk("cmpl-1", "m", 1, index=0, text="a"))
    out.CompletionResponse.model_validate(usage_chunk("cmpl-1", "m", 1, usage(1, 1), chat=False))
    out.ModelList.model_validate(models_response(["m"], 1))
    out.ErrorResponse.model_validate(error_body(400, "bad", param="n"))
    assert chat_chunk("c", "m", 1, index=0, text="a", first=True)["object"] == "chat.completion.chunk"


def test_message_rules_in_the_schema_match_the_template():
    doc.specialize(model_names=["m"], vocab_size=1024, max_model_len=64, api_key=False)
    message = api.openapi()["components"]["schemas"]["ChatMessage"]
    assert len(message["anyOf"]) == 3 and message["additionalProperties"] is False
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}, call]})
    assert "security" not in api.openapi()["paths"]["/v1/completions"]["post"]  # no key: no auth declared
