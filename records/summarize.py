#!/usr/bin/env python3
"""The records' table of a set of runs: time and final validation loss per group, side by side.

    python3 records/summarize.py [--target 3.28] [--phases 150:3,10] GROUP [GROUP ...]

A GROUP is a folder (its *.txt logs), or log files separated by commas, with an optional label:
`ours=records/2026-01-01_Name/ours`. The first group is the baseline of the +/-, p and ratio
columns. A run's time is the train_time of its final validation (in s), its loss that validation's
val_loss.

Columns: Time/Loss mu and sigma (sample standard deviation, n-1); +/- the difference of the mean
to the first row's; Time p a two-sided Welch t-test of the times against the first row's; p a
one-sided one-sample t-test that the losses are below --target (the records' criterion).

Then the median ms per step of each phase (the parts of the batch size schedule, then the
extension steps), pooled over a group's runs, and its ratio to the first group's phase of the same
steps: the phases come from a log's configuration block, else from --phases (for logs without one,
such as the PyTorch record's: `--phases 150:3,10` = 150 scheduled steps in 3 equal parts, then 10
extension steps), else one phase of all steps.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logs  # noqa: E402


def fmt(x, sign=False):
    if x is None:
        return "-"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def group_stats(label, runs, target, base=None):
    """One row of the table as a dict of numbers (None: undefined); base: the first row's dict."""
    times = [r.time_s for r in runs]
    losses = [r.loss for r in runs if r.loss is not None]
    row = {"label": label, "runs": len(runs), "times": times, "losses": losses,
           "time_mean": logs.mean(times), "time_std": logs.sample_std(times),
           "loss_mean": logs.mean(losses) if losses else None,
           "loss_std": logs.sample_std(losses) if losses else None,
           "time_diff": None, "time_p": None, "loss_diff": None, "loss_p": None}
    test = logs.t_test_less(losses, target) if losses else None
    row["loss_p"] = test[2] if test else None
    if base is not None:
        row["time_diff"] = row["time_mean"] - base["time_mean"]
        welch = logs.welch_t_test(times, base["times"])
        row["time_p"] = welch[2] if welch else None
        if row["loss_mean"] is not None and base["loss_mean"] is not None:
            row["loss_diff"] = row["loss_mean"] - base["loss_mean"]
    return row


def phase_stats(groups, spec):
    """[(label, [(Phase, median ms/step, ratio to the first group's)])]."""
    out, base = [], None
    for label, runs in groups:
        pooled, phases = {}, None
        for r in runs:
            ps = logs.run_phases(r, spec)
            phases = phases or ps
            times = r.step_times_ms()
            for p in ps:
                pooled.setdefault(p.index, []).extend(times[k] for k in range(p.first, p.last + 1) if k in times)
        rows = []
        for p in phases:
            med = logs.median(pooled[p.index]) if pooled.get(p.index) else None
            # only the same steps compare: a group split otherwise gets no ratio
            ref = base.get((p.first, p.last)) if base is not None else None
            ratio = med / ref if med is not None and ref else None
            rows.append((p, med, ratio))
        if base is None:
            base = {(p.first, p.last): med for p, med, _ in rows}
        out.append((label, rows))
    return out


def table(header, rows):
    """A Markdown table with padded columns (readable as text, pastes into a README)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def render(groups, target, spec):
    rows, base = [], None
    for label, runs in groups:
        row = group_stats(label, runs, target, base)
        base = base or row
        rows.append(row)
    first = rows[0]
    main = table(
        ["Group", "Runs", "Time μ", "Time σ", "Time +/-", "Time p", "Loss μ", "Loss σ", "Loss +/-", "p"],
        [[r["label"], r["runs"], fmt(r["time_mean"]), fmt(r["time_std"]),
          "" if r is first else fmt(r["time_diff"], True), "" if r is first else fmt(r["time_p"]),
          fmt(r["loss_mean"]), fmt(r["loss_std"]),
          "" if r is first else fmt(r["loss_diff"], True), fmt(r["loss_p"])] for r in rows])
    out = [main, "",
           f"Time: train_time of the final validation (s). Time p: two-sided Welch t-test against "
           f"{first['label']}. p: one-sided t-test that val_loss < {target}.", ""]
    for r in rows:
        out.append(f"{r['label']}: train_time (s) = [{', '.join(fmt(x) for x in r['times'])}]")
        out.append(f"{r['label']}: val_loss = [{', '.join(fmt(x) for x in r['losses'])}]")
    out.append("")
    prows = []
    for g, (label, phases) in enumerate(phase_stats(groups, spec)):
        for p, med, ratio in phases:
            prows.append([label, p.index + 1, p.label, p.tokens if p.tokens is not None else "-", fmt(med),
                          "" if g == 0 else fmt(ratio)])
    out.append(table(["Group", "Phase", "Steps", "Tokens/step", "Median ms/step", "Ratio"], prows))
    out.append("")
    out.append(f"Ratio: the median ms per step against {groups[0][0]}'s phase of the same steps.")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__[__doc__.index("A GROUP"):])
    ap.add_argument("--target", type=float, default=3.28, help="validation loss to beat (default 3.28)")
    ap.add_argument("--phases", help="phases of the logs without a configuration block: SCHEDULED[:PARTS][,EXTENSION] "
                    "steps, e.g. 150:3,10 (default: one phase)")
    ap.add_argument("groups", nargs="+", metavar="GROUP")
    a = ap.parse_args(argv)
    try:
        spec = logs.parse_phases(a.phases) if a.phases else None
    except ValueError as e:
        ap.error(str(e))
    try:
        groups = [logs.load_group(g) for g in a.groups]
        for _, runs in groups:
            for r in runs:
                if not r.finished:
                    print(f"summarize.py: warning: {r.path} ends at step {r.steps[-1].step}/{r.total}", file=sys.stderr)
                if r.loss is None:
                    print(f"summarize.py: warning: {r.path} has no validation; its time is its last step's",
                          file=sys.stderr)
        print(render(groups, a.target, spec))
    except logs.LogError as e:
        print(f"summarize.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
