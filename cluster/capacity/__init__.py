"""The capacity wing: what a shape would serve before anyone buys it — the simulator of the engine
(:mod:`.simulator`, driving the real scheduler), its step costs (:mod:`.stepcost`: the GPU roofline
of :mod:`cluster.costmodel`, a step's MoE layers pipelined over micro-batches by :mod:`.pipeline`,
or this machine's CPU profile, :mod:`.profile`), workloads and failures (:mod:`.workload`), and the
capacity search (:mod:`.search`). Used by `moeray simulate` / `moeray plan` and the benchmarks; the
runtime never imports it.
"""
