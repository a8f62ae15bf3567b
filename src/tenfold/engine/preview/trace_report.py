"""`tenfold plan --trace`'s comparison: the planner's per-rank memory terms beside what the traced
step held (tenfold.engine.preview.trace), per pipeline stage, and the step's collectives. No torch."""

from __future__ import annotations

from tenfold.plan.for_run import MEMORY_LINE_NAMES, fmt_bytes

COMPARED = ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
            "buffers_bytes", "peak_bytes")


def planned_stage(stage: str, pp: int) -> int:
    """The pipeline rank the planner's figures describe (MemoryBreakdown.stage: "only", "first",
    "last" or "pp rank N")."""
    if stage == "last":
        return pp - 1
    return int(stage.removeprefix("pp rank ")) if stage.startswith("pp rank ") else 0


def diff_percent(planned: float | None, traced: float | None) -> float | None:
    """100 (planned - traced) / traced: how far the plan is from the run (None where undefined)."""
    if planned is None or traced is None or traced == 0:
        return None if planned != traced else 0.0
    return round(100.0 * (planned - traced) / traced, 2)


DP_GROUPS = ("dp", "dp_shard", "dp_replicate")  # the mesh dimensions data parallelism reduces over


def compare(planned: dict, traces: list[dict], stage: int, planned_traffic: float | None = None,
            planned_cp: float | None = None, planned_all_to_all: float | None = None,
            planned_dp: float | None = None) -> dict:
    """{"stage", "memory": {key: {planned, traced, diff_percent}}, "stages": per-stage traced
    memory, "collectives": the compared stage's, "traffic": planned vs traced ring bytes,
    "cp_traffic": planned vs traced ring bytes on the cp group (None without cp), "all_to_all":
    planned vs traced ring bytes of the expert-parallel all-to-alls (group "ep"; None without ep),
    "dp_traffic": planned vs traced ring bytes on the data-parallel groups (`DP_GROUPS`)}."""
    traced = next(t for t in traces if t["stage"] == stage)
    memory = {k: {"planned": planned.get(k), "traced": traced["memory"].get(k),
                  "diff_percent": diff_percent(planned.get(k), traced["memory"].get(k))} for k in COMPARED}
    ring = sum(c["ring_bytes"] for c in traced["collectives"] if c["group_size"] > 1 and c["kind"] not in ("send", "recv"))
    out = {"stage": stage, "rank": traced["rank"], "batch": traced["batch"], "layout": traced["layout"], "memory": memory,
           "stages": [{"stage": t["stage"], "rank": t["rank"], "memory": t["memory"], "seconds": t["seconds"]}
                      for t in traces],
           "collectives": traced["collectives"],
           "traffic": {"planned": planned_traffic, "traced": ring, "diff_percent": diff_percent(planned_traffic, ring)}}
    if planned_cp is not None:
        cp_ring = sum(c["ring_bytes"] for c in traced["collectives"] if c.get("group") == "cp")
        out["cp_traffic"] = {"planned": planned_cp, "traced": cp_ring, "diff_percent": diff_percent(planned_cp, cp_ring)}
    if planned_dp is not None:
        dp_ring = sum(c["ring_bytes"] for c in traced["collectives"] if c.get("group") in DP_GROUPS)
        out["dp_traffic"] = {"planned": planned_dp, "traced": dp_ring, "diff_percent": diff_percent(planned_dp, dp_ring)}
    if planned_all_to_all is not None:
        a2a = sum(c["ring_bytes"] for c in traced["collectives"] if c["kind"] == "all_to_all" and c.get("group") == "ep")
        out["all_to_all"] = {"planned": planned_all_to_all, "traced": a2a,
                             "diff_percent": diff_percent(planned_all_to_all, a2a)}
    return out


def print_comparison(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"plan vs trace: memory per rank (pipeline stage {result['stage']}, rank {result['rank']}, one step)",
              title_justify="left")
    for col in ("", "planned", "traced", "plan - trace"):
        t.add_column(col, justify="left" if not col else "right")
    for key, row in result["memory"].items():
        d = row["diff_percent"]
        t.add_row(MEMORY_LINE_NAMES.get(key, key.removesuffix("_bytes")), fmt_bytes(row["planned"]),
                  fmt_bytes(row["traced"]), "-" if d is None else f"{d:+.1f}%")
    console.print(t)
    if len(result["stages"]) > 1:
        s = Table(title="traced peak per pipeline stage", title_justify="left")
        for col in ("stage", "rank", "params", "activations", "peak", "traced in"):
            s.add_column(col, justify="right")
        for st in result["stages"]:
            m = st["memory"]
            s.add_row(str(st["stage"]), str(st["rank"]), fmt_bytes(m["params_bytes"]), fmt_bytes(m["activations_bytes"]),
                      fmt_bytes(m["peak_bytes"]), f"{st['seconds']:.1f} s")
        console.print(s)
    c = Table(title="collectives per step, this rank (ring bytes: what one rank sends, nccl-tests' bus factors)",
              title_justify="left")
    for col in ("kind", "group", "group size", "calls", "payload", "ring bytes"):
        c.add_column(col, justify="right")
    for row in result["collectives"]:
        c.add_row(row["kind"], row.get("group") or "-", str(row["group_size"]), str(row["count"]),
                  fmt_bytes(row["payload_bytes"]), fmt_bytes(row["ring_bytes"]))
    captions = []
    traffic = result["traffic"]
    if traffic["planned"] is not None:
        d = traffic["diff_percent"]
        captions.append(f"collective bytes per step (groups > 1, no point-to-point): planned "
                        f"{fmt_bytes(traffic['planned'])}, traced {fmt_bytes(traffic['traced'])}"
                        + ("" if d is None else f" ({d:+.1f}%)"))
    cp = result.get("cp_traffic")
    if cp is not None:
        d = cp["diff_percent"]
        captions.append(f"cp group bytes per step (K/V all-gather and reduce-scatter): planned {fmt_bytes(cp['planned'])}, "
                        f"traced {fmt_bytes(cp['traced'])}" + ("" if d is None else f" ({d:+.1f}%)"))
    dp = result.get("dp_traffic")
    if dp is not None:
        d = dp["diff_percent"]
        captions.append(f"data-parallel bytes per step (all-gathers, reduce-scatters, all-reduces): planned "
                        f"{fmt_bytes(dp['planned'])}, traced {fmt_bytes(dp['traced'])}" + ("" if d is None else f" ({d:+.1f}%)"))
    a2a = result.get("all_to_all")
    if a2a is not None:
        d = a2a["diff_percent"]
        captions.append(f"expert-parallel all-to-all bytes per step: planned {fmt_bytes(a2a['planned'])}, "
                        f"traced {fmt_bytes(a2a['traced'])}" + ("" if d is None else f" ({d:+.1f}%)"))
    if captions:
        c.caption = "\n".join(captions)
    console.print(c)
