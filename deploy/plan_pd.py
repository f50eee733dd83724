"""``moeray plan --pd-prefill``: the two pools of a prefill/decode deployment, each planned on its own
devices (the planner's arithmetic in its layout), and what one prompt's blocks cost to cross between them."""

from __future__ import annotations

import math


def plan_pools(model_cfg, pd_prefill: str, *, layout: str, nodes: int, gpus_per_node: int, attention, experts,
               workers, prompt_tokens: int, **kw) -> tuple[dict, str, bool]:
    """(JSON, text, both pools fit). The prefill pool takes ``pd_prefill`` (N colocated workers, or AxE) of the
    cluster's ``nodes × gpus_per_node`` devices, the decode pool the rest (``--attention/--experts`` or
    ``--workers`` in ``layout``; by default all of them: colocated workers, or 1 attention replica and expert
    actors on the others)."""
    from cluster.capacity.pd import Link, transfer_bytes
    from cluster.planner import format_plan, plan_colocated, plan_shape

    from .simulate import pool_shape

    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    prefill = pool_shape(pd_prefill)
    rest = nodes * gpus_per_node - prefill.devices
    if rest < 1:
        raise ValueError(f"--pd-prefill {pd_prefill} takes {prefill.devices} devices: the cluster has "
                         f"{nodes * gpus_per_node} (--nodes × --gpus-per-node), none left for the decode pool")

    def plan(shape_devices: int, colocated: bool, a=None, e=None, w=None):
        n = math.ceil(shape_devices / gpus_per_node)
        per = min(gpus_per_node, shape_devices)
        if colocated:
            return plan_colocated(model_cfg, nodes=n, gpus_per_node=per, workers=w or shape_devices, **kw)
        return plan_shape(model_cfg, nodes=n, gpus_per_node=per, attention=a or 1,
                          experts=e or max(shape_devices - (a or 1), 1), **kw)

    pre = plan(prefill.devices, prefill.colocated, prefill.attention, prefill.experts, prefill.attention)
    dec = plan(rest, layout == "colocated", attention, experts, workers)
    nbytes = transfer_bytes(model_cfg, prompt_tokens, kw["dtype_bytes"])
    seconds = Link(gbps=kw["link_gbps"]).seconds(nbytes)
    transfer = {"prompt_tokens": prompt_tokens, "bytes": nbytes, "seconds": seconds, "link_gbps": kw["link_gbps"]}
    out = {"prefill": pre.to_dict(), "decode": dec.to_dict(), "transfer": transfer}
    text = "\n".join([f"prefill pool ({prefill.devices} devices)", format_plan(pre, None), "",
                      f"decode pool ({rest} devices)", format_plan(dec, None), "",
                      f"transfer: a {prompt_tokens:,}-token prompt's blocks, {nbytes / 1e6:,.1f} MB, cross once to "
                      f"its decode replica: {seconds * 1e3:,.2f} ms at {kw['link_gbps']:g} Gb/s"])
    return out, text, pre.fits and dec.fits
