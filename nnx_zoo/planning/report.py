"""The planner's table: one row per compiled candidate, memory in GiB per device."""

from __future__ import annotations

from nnx_zoo.planning.compile import Plan

GiB = 1024**3


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def _collectives(plan: Plan) -> str:
    rows = []
    for row in plan.to_json()["collectives_by_axis"]:
        rows.append(f"{row['op']}x{row['count']}@{row['axes']}({row['bytes'] / GiB:.2f}G)")
    return " ".join(rows) or "-"


def table(plans: list[Plan]) -> str:
    header = [
        "strategy",
        "mesh",
        "remat",
        "k",
        "pipeline",
        "params",
        "opt",
        "grads",
        "argument",
        "temp",
        "peak",
        "chip",
        "fits",
        "bound_s",
        "bound_MFU",
        "forecast_s",
        "forecast_MFU",
        "compile_s",
    ]
    rows = [header]
    for p in plans:
        c = p.candidate
        rows.append(
            [
                f"{c.strategy}({c.context_parallel})" if c.context_parallel else c.strategy,
                "x".join(f"{a}{n}" for a, n in p.mesh.items()),
                c.remat,
                str(c.micro_batches),
                # A pipeline's schedule and micro-batches whose activations it keeps at once.
                f"{p.schedule.schedule}/{p.schedule.in_flight}" if p.schedule else "-",
                _gib(p.state.params),
                _gib(p.state.optimizer),
                _gib(p.state.gradients),
                _gib(p.argument_bytes),
                _gib(p.temp_bytes),
                _gib(p.required_bytes),
                _gib(p.target.chip.memory_bytes),
                "yes" if p.fits else "NO",
                f"{p.estimate.step_seconds:.4g}",
                f"{p.estimate.mfu:.1%}",
                f"{p.forecast.step_seconds:.4g}" if p.forecast else "-",
                f"{p.forecast.mfu:.1%}" if p.forecast else "-",
                f"{p.compile_seconds:.0f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "GiB per device; peak = XLA's peak, or arguments + outputs + temporaries if larger. "
        "pipeline: schedule/micro-batches in flight (whose saved activations a device holds). "
        "forecast_s: what a step should take (nnx_zoo/planning/estimate.py); bound_s: compute "
        "at peak, "
        "no step is faster; '-': no forecast (simulated CPU, compile refused)."
    )
    for p in plans:
        largest = ", ".join(f"{path} {_gib(b)}" for path, b in p.state.largest_params)
        kernels = ", ".join(f"{k}x{n}" for k, n in p.kernels.items()) or "none"
        lines.append(f"{p.candidate.describe()}:")
        lines.append(f"  largest parameters (GiB/device): {largest}")
        lines.append(f"  collectives per step: {_collectives(p)}")
        lines.append(f"  custom-call kernels: {kernels}")
        if "all_to_all_bytes" in p.moe:
            lines.append(
                f"  MoE token exchange: {p.moe['all_to_all_bytes'] / GiB:.3g} GiB all-to-all per"
                f" step = {p.moe['all_to_all_over_payload']}x the routed payload"
            )
        if "load_spread_expert" in p.moe:
            lines.append(
                f"  router load ({p.moe['load_from']}, last {p.moe['load_steps']} steps): "
                f"busiest expert {p.moe['load_spread_expert']}x the mean (worst layer); busiest "
                f"expert shard {p.moe['load_spread_shard']}x (mean over layers): its grouped "
                "matmuls and received rows are that many times a balanced router's"
            )
        if p.host_temp_bytes:
            lines.append(f"  pinned host memory (offloaded activations): {_gib(p.host_temp_bytes)}")
        e = p.estimate
        lines.append(
            f"  step: compute {e.compute_seconds:.4g} s + exposed comm "
            f"{e.exposed_comm_seconds:.4g} s, overlapped comm {e.overlapped_comm_seconds:.4g} s"
            f"; bound {e.step_seconds:.4g} s (compute at peak: no step is faster)"
        )
        f = p.forecast
        if f is not None:
            lines.append(
                f"  forecast: matmul {f.matmul_seconds:.4g} s (at {f.matmul_efficiency:.0%} of "
                f"peak) + attention {f.attention_seconds:.4g} s ({f.attention_efficiency:.0%}) "
                f"+ memory-bound {f.memory_seconds:.4g} s ({f.memory_bytes / GiB:.1f} GiB) + "
                f"kernel gaps {f.host_seconds:.4g} s + comm = {f.step_seconds:.4g} s"
            )
    return "\n".join(lines)
