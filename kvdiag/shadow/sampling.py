"""How the shadow figures were sampled, in one line: from one ``ShadowBudget`` (as a dict), the
same words in the report, the demo's summary and top (no pandas here: top imports it)."""

from __future__ import annotations

import math


def sampling_line(budget: dict) -> str:
    """One line on how the shadow figures were sampled, from one ``ShadowBudget`` (as a dict):
    steps sampled of those offered (the achieved rate), the rate in force and its ceiling, and
    the CPU spent against the budget."""

    def num(key):
        v = budget.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    offered, sampled = int(budget["steps_offered"]), int(budget["steps_sampled"])
    parts = [f"{sampled} of {offered} decode steps sampled (achieved rate {sampled / max(offered, 1):.4f})"]
    if num("sample_rate") is not None:
        ceiling = num("sample_rate_max")
        parts.append(f"rate in force {num('sample_rate'):.4f}" + (f" of at most {ceiling:g}" if ceiling is not None else ""))
    what = "CPU" if budget.get("clock") == "cpu" else "wall time"
    if budget["elapsed_ns"]:
        used = f"shadow {what} {budget['spent_ns'] / budget['elapsed_ns']:.2%} of the engine's"
        frac = num("budget_frac")
        parts.append(used + (f" (budget {frac:.2%})" if frac is not None else " (no budget)"))
    if int(budget["steps_skipped_budget"]) or int(budget["steps_dropped"]):
        parts.append(f"{int(budget['steps_skipped_budget'])} skipped for the budget, "
                     f"{int(budget['steps_dropped'])} dropped (worker busy)")
    return "; ".join(parts)
