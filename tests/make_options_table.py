"""Run the options sweep and write docs/options.md from its results.

    PYTHONPATH=$PWD/tests python tests/make_options_table.py     # rewrites docs/options.md

tests/test_options.py runs the same sweep once per session and checks that the committed page equals this render,
so the page cannot drift from what the sweep finds. The grid and the tolerances: tests/options_grid.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import options_grid as grid

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "options.md"
EPS32 = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps
# The launcher's setting for 16-bit experts, as stock loads them (the router aux row's model is a mixture of experts)
SFT_ENV = {"HF_FSDP_QLORA_QUANTIZE_EXPERTS": "0"}
LOG_KEYS = ("loss", "grad_norm", "learning_rate", "num_input_tokens_seen")


def run_sweep(work: Path, fork: bool | None = None) -> dict:
    """{"stock": {key: record}, "cells": {key: record}, "tensors": folder}: the stock run in one process, then one
    2-rank launch per FSDP version (dist_utils' launches: a free port, a timeout, forked ranks by default)."""
    import dist_utils
    from tiny_models import build_tiny_model

    for arch in {grid.option(name)["model"]["arch"] for name in grid.OPTIONS}:
        build_tiny_model(work / "models" / arch, arch)
    stock = work / "stock"
    dist_utils.check(
        dist_utils.run_single("options_sweep.py", "--models", str(work / "models"), "--out", str(stock), "--stock",
                              timeout=600, fork=fork)
    )  # fmt: skip
    cells = {}
    for version, route in sorted({(column["version"], column["route"]) for column in grid.SETTINGS.values()}):
        out = work / f"fsdp{version}_{route}"
        args = ("--models", str(work / "models"), "--out", str(out), "--fsdp-version", str(version))
        args += ("--inits", str(stock), "--route", route)
        config = f"cpu_fsdp{version}_rehearsal.yaml"
        if route == "sft":  # a script run unchanged: every trainer it builds made ours by the launcher
            proc = dist_utils.launch_via_run(config, "options_sweep.py", *args, timeout=900, fork=fork, env=SFT_ENV)
        else:
            proc = dist_utils.accelerate_launch(config, "options_sweep.py", *args, timeout=900, fork=fork)
        dist_utils.check(proc)
        cells.update({k: {**r, "tensors": str(out / f"{k}.pt")} for k, r in dist_utils.read_results(out)[0].items()})
    stock_records = json.loads((stock / "stock.json").read_text())
    for key, value in stock_records.items():
        value["tensors"] = str(stock / f"{key}.pt")
    return {"stock": stock_records, "cells": cells}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _compare_logs(ours: list, theirs: list) -> str | None:
    if len(ours) != len(theirs):
        return f"{len(ours)} logged steps, stock {len(theirs)}"
    for step, (mine, stock) in enumerate(zip(ours, theirs), 1):
        for name in LOG_KEYS:
            if name in stock and (name not in mine or _rel(float(mine[name]), float(stock[name])) > grid.LOSS_RTOL):
                return f"step {step} {name} {mine.get(name)} vs stock {stock[name]}"
    return None


def _compare_adapter(ours: dict, theirs: dict, init: dict) -> str | None:
    if set(ours) != set(theirs):
        return f"adapter names differ: {sorted(set(ours) ^ set(theirs))[:4]}"
    for name in sorted(theirs):
        change = (theirs[name] - init[name]).abs().max().item()
        error = (ours[name] - theirs[name]).abs().max().item()
        rounding = grid.ADAPTER_ULPS * EPS32 * theirs[name].abs().max().item()  # float32 steps of the weight itself
        if error > grid.ADAPTER_RTOL * change + rounding:
            return f"adapter {name}: off by {error:.3g}, stock change {change:.3g}"
    return None


def _compare_outputs(ours: dict, theirs: dict, mine: dict, stock: dict) -> str | None:
    atol = grid.LOGITS_ATOL_BY_MODEL.get(stock["model"], grid.LOGITS_ATOL)
    for name in ("eval_loss", "test_loss"):
        if name in stock and (mine.get(name) is None or _rel(mine[name], stock[name]) > grid.LOSS_RTOL):
            return f"{name} {mine.get(name)} vs stock {stock[name]}"
    for name in ("predictions", "label_ids"):
        if name not in theirs:
            continue
        got, want = ours.get(name), theirs[name]
        if got is None or tuple(got.shape) != tuple(want.shape):
            return f"{name} shape {None if got is None else tuple(got.shape)} vs stock {tuple(want.shape)}"
        if (got.float() - want.float()).abs().max().item() > atol:
            return f"{name} differ by {(got.float() - want.float()).abs().max().item():.3g}"
    return None


def compare(cell: dict, stock: dict, init: Path) -> tuple[str, str]:
    """(status, detail) of one cell: equal, refused (with the error's text) or failed (with what differs)."""
    import torch

    if cell["outcome"] == "raised":
        # A refusal: this package's error, or the very error stock gives, before the first step; else a failure
        refused = cell["before_first_step"] and (cell["ours"] or cell["error"] == stock.get("error"))
        return ("refused" if refused else "failed"), cell["error"]
    if "error" in stock:
        return "failed", f"trained where stock fails ({stock['error'][:200]}): nothing to compare with"
    if cell.get("distributed_type") != "DistributedType.FSDP" or not (
        cell["engaged"]["flat_params"] or cell["engaged"]["fsdp2_modules"]
    ):
        return "failed", f"FSDP did not engage: {cell.get('distributed_type')} {cell.get('engaged')}"
    ours, theirs = torch.load(cell["tensors"]), torch.load(stock["tensors"])
    init = torch.load(init)
    problem = (
        _compare_logs(cell["logs"], stock["logs"])
        or _compare_outputs(ours, theirs, cell, stock)
        or _compare_adapter(ours["adapter"], theirs["adapter"], init)
    )
    return ("failed", problem) if problem else ("equal", "")


def statuses(sweep: dict) -> dict:
    """{(option, setting): (status, detail)} of every cell of the grid."""
    found = {}
    for option, setting in grid.cells():
        why = grid.not_applicable(option, setting)
        cell = sweep["cells"].get(grid.cell_key(option, setting))
        if why:
            found[option, setting] = ("n/a", why)
        elif cell is None:
            found[option, setting] = ("failed", "the cell did not run")
        else:
            run = grid.stock_run(option, setting)
            stock = {**sweep["stock"][grid.stock_key(run)], "model": run[1]}
            found[option, setting] = compare(
                cell, stock, grid.init_file(Path(stock["tensors"]).parent, option, run[1])
            )
    return found


def _intro() -> str:
    return (
        "Each cell trains a tiny 4-bit Llama (NF4, float32, all-linear LoRA r=4) for "
        f"{grid.STEPS} steps on 2 CPU ranks with the option of its row under the setting of its column, and compares "
        "it with stock transformers + peft in one process (float32 adapters, the same initial adapter, the same "
        "global batches): every logged loss, gradient norm and learning rate, the evaluation's loss, the prediction "
        "tensors, and the adapter after training. `equal`: within the tolerances "
        f"(losses {grid.LOSS_RTOL:g} relative; the adapter's change {grid.ADAPTER_RTOL:g} relative plus "
        f"{grid.ADAPTER_ULPS} float32 steps of the weight; logits "
        f"{grid.LOGITS_ATOL:g}; on the 8-bit base {grid.LOGITS_ATOL_BY_MODEL['int8']:g}, where bitsandbytes' stock "
        "matmul also quantizes the activations and ours does not). `refused`: stopped before the first step with an error naming the option (below). "
        "`n/a`: the combination cannot exist. With `average_tokens_across_devices=False` each data-parallel rank "
        "divides by its own labelled tokens: the stock figure is that (each rank's share of the batch averaged "
        "on its own, then the ranks averaged), computed in the one process. Likewise a router aux loss is each rank's "
        "own: the stock figure adds `router_aux_loss_coef` x the mean of the ranks' shares' aux losses (stock "
        "transformers on N ranks multiplies it by N: transformers issue #48690; ours keeps the coefficient). In trl's column the stock run is trl's `SFTTrainer` with the adapters kept in "
        "float32 as peft makes them (trl casts a quantized model's adapters to bf16; this package trains float32 "
        "master weights)."
    )


def render(found: dict) -> str:
    settings = list(grid.SETTINGS)
    lines = [
        "# Options against stock",
        "",
        "<!-- generated by tests/make_options_table.py from the options sweep; tests/test_options.py keeps it equal -->",
        "",
        _intro(),
        "",
        "| option | " + " | ".join(settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for option in grid.OPTIONS:
        lines.append(f"| {option} | " + " | ".join(found[option, s][0] for s in settings) + " |")
    totals = {}
    for status, _ in found.values():
        totals[status] = totals.get(status, 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{n} {s}" for s, n in sorted(totals.items())) + "."]
    lines += ["", "## Not in this grid yet", ""]
    lines += [f"- {name}: {where}." for name, where in grid.NOT_IN_GRID.items()]
    refusals = [(o, s, d) for (o, s), (st, d) in found.items() if st == "refused"]
    if refusals:
        lines += ["", "## What a refusal says", ""]
        lines += [f"- **{o}** under {s}: {d.splitlines()[0]}" for o, s, d in refusals]
    return "\n".join(lines) + "\n"


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = statuses(run_sweep(Path(tmp)))
    PAGE.write_text(render(found))
    failed = [(k, v) for k, v in found.items() if v[0] == "failed"]
    for (option, setting), (_, detail) in failed:
        print(f"FAILED {option} under {setting}: {detail}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
