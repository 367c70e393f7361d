#!/usr/bin/env python3
"""Validation loss against training time and against step, one line per run, one colour per group.

    python3 records/plot.py -o curves.png GROUP [GROUP ...]

GROUPs as for summarize.py: a folder (its *.txt logs) or comma-separated log files, with an
optional `label=` prefix. Needs matplotlib (pip install matplotlib); the tables do not.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logs  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    ap.add_argument("--title", default="", help="title above the two panels")
    ap.add_argument("--ymax", type=float, help="upper limit of the loss axis (the first validation is ~10.8)")
    ap.add_argument("groups", nargs="+", metavar="GROUP")
    a = ap.parse_args(argv)
    try:
        # no display needed: the figure only goes to a file
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        groups = [logs.load_group(g) for g in a.groups]
    except logs.LogError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2

    fig, (ax_time, ax_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for g, (label, runs) in enumerate(groups):
        colour = colours[g % len(colours)]
        for i, run in enumerate(runs):
            vals = run.validations()
            if not vals:
                print(f"plot.py: warning: {run.path} has no validation lines", file=sys.stderr)
                continue
            steps, times, losses = zip(*vals)
            # one legend entry per group, not per run
            name = f"{label} ({len(runs)} run{'s' if len(runs) != 1 else ''})" if i == 0 else None
            style = dict(color=colour, alpha=0.8, linewidth=1, marker="." if len(vals) < 50 else None)
            ax_time.plot(times, losses, label=name, **style)
            ax_step.plot(steps, losses, label=name, **style)
    for ax, xlabel in ((ax_time, "training time (s)"), (ax_step, "step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
        if a.ymax is not None:
            ax.set_ylim(top=a.ymax)
        ax.legend()
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.output, dpi=150)
    print(a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
