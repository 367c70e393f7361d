#!/usr/bin/env python3
"""Tests of records/logs.py, summarize.py and plot.py: python3 records/test_records.py
(standard library only; exit 0 when all pass)."""
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import logs  # noqa: E402
import summarize  # noqa: E402

RULE = "=" * 100


# ---- independent references for Student's t CDF


def t_cdf_closed_form(t, nu):
    """Abramowitz & Stegun 26.7.3/26.7.4: A(t|nu) = P(|T| <= |t|) for integer nu as a finite
    series in theta = atan(t/sqrt(nu)); no incomplete beta involved."""
    th = math.atan(abs(t) / math.sqrt(nu))
    c2 = math.cos(th) ** 2
    if nu % 2 == 0:  # sin(th) * (1 + 1/2 c^2 + 1.3/(2.4) c^4 + ... up to c^(nu-2))
        term, s = 1.0, 1.0
        for j in range(1, nu // 2):
            term *= (2 * j - 1) / (2 * j) * c2
            s += term
        a = math.sin(th) * s
    elif nu == 1:
        a = 2 * th / math.pi
    else:  # 2/pi (th + sin cos (1 + 2/3 c^2 + 2.4/(3.5) c^4 + ... up to c^(nu-3)))
        term, s = 1.0, 1.0
        for j in range(1, (nu - 1) // 2):
            term *= (2 * j) / (2 * j + 1) * c2
            s += term
        a = 2 / math.pi * (th + math.sin(th) * math.cos(th) * s)
    return 0.5 + math.copysign(a / 2, t)


def t_cdf_simpson(t, nu, n=4000):
    """0.5 + the integral of the t density from 0 to t, Simpson's rule (any real nu)."""
    k = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(nu * math.pi)
    f = lambda x: k * (1 + x * x / nu) ** (-(nu + 1) / 2)
    h = t / n
    s = f(0) + f(t) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return 0.5 + s * h / 3


class TDistribution(unittest.TestCase):
    def test_known_values(self):
        # tables of the t distribution (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), 1 - P(T > t):
        # t_0.95(5) = 2.015, t_0.975(10) = 2.228, t_0.975(30) = 2.042, t_0.995(1) = 63.657
        cases = [(2.0, 5, 0.94903026), (1.0, 1, 0.75), (2.015048, 5, 0.95), (2.228139, 10, 0.975),
                 (2.042272, 30, 0.975), (63.65674, 1, 0.995),
                 # = 1 - 0.9842766: the two-sided p of t = 2.5 on 10 df is 0.031447
                 (-2.5, 10, 0.01572342)]
        for t, nu, want in cases:
            self.assertAlmostEqual(logs.t_cdf(t, nu), want, delta=2e-7, msg=f"t={t} nu={nu}")

    def test_against_closed_forms(self):
        for nu in (1, 2, 3, 4, 5, 10, 30):
            for t in (-6.0, -2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 2.0, 4.5):
                self.assertAlmostEqual(logs.t_cdf(t, nu), t_cdf_closed_form(t, nu), delta=1e-12, msg=f"t={t} nu={nu}")

    def test_non_integer_nu(self):
        for nu in (0.7, 2.5, 2.9411764705882355, 7.5, 41.3):
            for t in (-3.0, -1.2, 0.5, 1.5, 2.7):
                self.assertAlmostEqual(logs.t_cdf(t, nu), t_cdf_simpson(t, nu), delta=1e-10, msg=f"t={t} nu={nu}")

    def test_large_nu_is_normal(self):
        # Phi(1.96) = 0.9750021 (normal table); t(1e6) differs from it by ~1.4e-7
        self.assertAlmostEqual(logs.t_cdf(1.96, math.inf), 0.9750021, delta=1e-7)
        self.assertAlmostEqual(logs.t_cdf(1.96, 1e6), 0.9750021, delta=5e-7)
        self.assertAlmostEqual(logs.t_cdf(-1.96, 1e6), 1 - 0.9750021, delta=5e-7)

    def test_symmetry_and_limits(self):
        self.assertEqual(logs.t_cdf(0.0, 3.3), 0.5)
        self.assertAlmostEqual(logs.t_cdf(1.7, 6.2) + logs.t_cdf(-1.7, 6.2), 1.0, delta=1e-14)
        self.assertLess(logs.t_cdf(-1e6, 4), 1e-20)


class Tests(unittest.TestCase):
    def test_welch_equal_variances(self):
        # a: mean 102, s^2 = 4; b: mean 105, s^2 = 4 (n = 3 each): t = -3/sqrt(4/3 + 4/3) = -1.8371173,
        # nu = (8/3)^2 / (2 (4/3)^2/2) = 4, p = 2 F(t; 4) by A&S 26.7.3 = 0.1400660
        t, nu, p = logs.welch_t_test([100, 102, 104], [103, 105, 107])
        self.assertAlmostEqual(t, -3 / math.sqrt(8 / 3), delta=1e-12)
        self.assertAlmostEqual(nu, 4.0, delta=1e-12)
        self.assertAlmostEqual(p, 2 * t_cdf_closed_form(-3 / math.sqrt(8 / 3), 4), delta=1e-12)
        self.assertAlmostEqual(p, 0.1400660, delta=1e-6)

    def test_welch_unequal_variances(self):
        # b: mean 105, s^2 = 1: t = -3/sqrt(5/3) = -2.3237900,
        # nu = (5/3)^2 / ((4/3)^2/2 + (1/3)^2/2) = 50/17, p by Simpson integration of the density
        t, nu, p = logs.welch_t_test([100, 102, 104], [104, 105, 106])
        self.assertAlmostEqual(t, -3 / math.sqrt(5 / 3), delta=1e-12)
        self.assertAlmostEqual(nu, 50 / 17, delta=1e-12)
        self.assertAlmostEqual(p, 2 * t_cdf_simpson(-3 / math.sqrt(5 / 3), 50 / 17), delta=1e-10)
        self.assertIsNone(logs.welch_t_test([1.0], [2.0, 3.0]))
        self.assertIsNone(logs.welch_t_test([1.0, 1.0], [2.0, 2.0]))

    def test_one_sample_less(self):
        # mean 3.275, s = 0.005, n = 3: t = -0.005/(0.005/sqrt 3) = -sqrt 3 on 2 df;
        # F(t; 2) = 1/2 + t/(2 sqrt(2 + t^2)) = 1/2 - sqrt(3/20) = 0.1127017
        t, nu, p = logs.t_test_less([3.27, 3.275, 3.28], 3.28)
        self.assertAlmostEqual(t, -math.sqrt(3), delta=1e-9)
        self.assertEqual(nu, 2)
        self.assertAlmostEqual(p, 0.5 - math.sqrt(3 / 20), delta=1e-9)
        self.assertIsNone(logs.t_test_less([3.27], 3.28))

    def test_sample_std_and_median(self):
        self.assertAlmostEqual(logs.sample_std([100, 102, 104]), 2.0)
        self.assertIsNone(logs.sample_std([1.0]))
        self.assertEqual(logs.median([3, 1, 2]), 2)
        self.assertEqual(logs.median([4, 1, 2, 3]), 2.5)


# ---- synthetic logs

CONFIG = """# configuration
command_line = ./train_gpt --num_scheduled_iterations 6 --num_extension_iterations 2
world_size = 1
num_scheduled_iterations = 6
num_extension_iterations = 2
train_bs_schedule = 1000,2000,3000
train_bs_extension = 3000
# end configuration"""

# what an embedded source looks like: the words of step lines inside code lines, and one whole
# line that matches the step format (in a docstring), before the rule
SOURCE = """#include <cstdio>
// log lines look like "step:3/8 val_loss:4.0000 train_time:100ms step_avg:33.33ms"
printf("step:%lld/%lld val_loss:%.4f train_time:%.0fms step_avg:%.2fms", step, n, loss, t, t / step);
    print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms")
step:5/8 val_loss:1.0000 train_time:1ms step_avg:1.00ms
# configuration
train_bs_schedule = 1,1,1
# end configuration
val_loss = 0"""


def step_lines(step_ms, final_loss, val_every=None, total=None):
    """Step lines of a run whose step k takes step_ms[k-1] ms, with a validation at step 0, every
    val_every steps and at the end (a validation repeats the clock of the step before it)."""
    total = total or len(step_ms)
    out, t = [f"step:0/{total} val_loss:10.8258 train_time:0ms step_avg:0.00ms"], 0
    for k, ms in enumerate(step_ms, 1):
        t += ms
        out.append(f"step:{k}/{total} train_time:{t}ms step_avg:{t / k:.2f}ms")
        if k == total:
            out.append(f"step:{k}/{total} val_loss:{final_loss:.4f} train_time:{t}ms step_avg:{t / k:.2f}ms")
        elif val_every and k % val_every == 0:
            out.append(f"step:{k}/{total} val_loss:{5.0 - k / 100:.4f} train_time:{t}ms step_avg:{t / k:.2f}ms")
    return out


def full_log(lines, config=True):
    parts = [SOURCE, RULE, "Running CUDA 13.0", CONFIG if config else "", "nvidia-smi ...", RULE] + lines
    return "\n".join(parts + ["peak memory in use: 44589 MiB (device total - free at its highest)"]) + "\n"


class Parsing(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_source_text_does_not_count(self):
        run = logs.parse_log(self.write("a.txt", full_log(step_lines([10, 20, 30, 40, 50, 60, 70, 80], 3.2712, 4))))
        self.assertEqual([s.step for s in run.steps], [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8])
        self.assertEqual(run.total, 8)
        self.assertEqual(run.loss, 3.2712)
        self.assertAlmostEqual(run.time_s, 0.36)
        self.assertTrue(run.finished)
        # the configuration block after the rule, not the one in the source
        self.assertEqual(run.config["train_bs_schedule"], "1000,2000,3000")
        self.assertEqual(run.validations(), [(0, 0.0, 10.8258), (4, 0.1, 4.96), (8, 0.36, 3.2712)])

    def test_whole_lines_only(self):
        lines = step_lines([10, 10], 3.5)
        text = "\n".join([" " + lines[1], lines[1] + " ", "x" + lines[2], lines[1].replace("ms ", "ms  ")] + lines)
        run = logs.parse_text(text)
        self.assertEqual(len(run.steps), len(lines))

    def test_step_lines_only(self):
        # the PyTorch record's logs as committed: no source, no rule, no configuration
        run = logs.parse_log(self.write("b.txt", "\n".join(step_lines([5] * 8, 3.3)) + "\n"))
        self.assertEqual(run.config, {})
        self.assertEqual(len(run.steps), 10)
        self.assertEqual(run.loss, 3.3)
        self.assertEqual(run.step_times_ms(), {k: 5 for k in range(1, 9)})

    def test_no_step_lines(self):
        path = self.write("c.txt", SOURCE + "\n" + RULE + "\nstep:1/8 train_time:5ms\n")
        with self.assertRaises(logs.LogError) as e:
            logs.parse_log(path)
        self.assertIn("no step lines", str(e.exception))
        r = subprocess.run([sys.executable, os.path.join(HERE, "summarize.py"), path], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no step lines", r.stderr)

    def test_missing_and_empty(self):
        os.makedirs(os.path.join(self.dir, "empty"))
        for arg, msg in ((os.path.join(self.dir, "nothing"), "no such file or folder"),
                         (os.path.join(self.dir, "empty"), "no logs (*.txt)")):
            r = subprocess.run([sys.executable, os.path.join(HERE, "summarize.py"), arg], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(msg, r.stderr)

    def test_step_times_skip_validation(self):
        # validations at 0, 4 and 8 repeat the clock: no step gets the validation's line as its own
        run = logs.parse_text(full_log(step_lines([10, 20, 30, 40, 50, 60, 70, 80], 3.2, 4)))
        times = run.step_times_ms()
        self.assertEqual(times, {k: 10 * k for k in range(1, 9)})
        self.assertEqual(sum(times.values()), run.final.train_time_ms)

    def test_phases(self):
        run = logs.parse_text(full_log(step_lines([1] * 8, 3.2)))
        # 6 scheduled steps in thirds (get_bs: int(3 * s/6)), then 2 extension steps
        got = [(p.first, p.last, p.tokens) for p in logs.run_phases(run)]
        self.assertEqual(got, [(1, 2, 1000), (3, 4, 2000), (5, 6, 3000), (7, 8, 3000)])
        bare = logs.parse_text("\n".join(step_lines([1] * 8, 3.2)))
        self.assertEqual([(p.first, p.last) for p in logs.run_phases(bare)], [(1, 8)])
        spec = logs.parse_phases("6:3,2")
        self.assertEqual([(p.first, p.last, p.tokens) for p in logs.run_phases(bare, spec)],
                         [(1, 2, None), (3, 4, None), (5, 6, None), (7, 8, None)])
        # 160 = 150 in thirds + 10: 1-50, 51-100, 101-150, 151-160
        bare160 = logs.parse_text("\n".join(step_lines([1] * 160, 3.2)))
        self.assertEqual([(p.first, p.last) for p in logs.run_phases(bare160, logs.parse_phases("150:3,10"))],
                         [(1, 50), (51, 100), (101, 150), (151, 160)])
        with self.assertRaises(logs.LogError):
            logs.run_phases(bare, logs.parse_phases("150:3,10"))
        with self.assertRaises(ValueError):
            logs.parse_phases("3:x")

    def test_group_specs(self):
        a = self.write("ours/a.txt", "\n".join(step_lines([1] * 8, 3.2)))
        b = self.write("ours/b.txt", "\n".join(step_lines([1] * 8, 3.3)))
        self.write("ours/notes.md", "not a log")
        self.assertEqual(logs.load_group(os.path.join(self.dir, "ours"))[0], "ours")
        self.assertEqual(len(logs.load_group(os.path.join(self.dir, "ours"))[1]), 2)
        label, runs = logs.load_group("mine=" + a + "," + b)
        self.assertEqual((label, [r.loss for r in runs]), ("mine", [3.2, 3.3]))
        self.assertEqual(logs.load_group(a + "," + b)[0], "ours")
        self.assertEqual(logs.load_group(a)[0], "a")


class Summary(unittest.TestCase):
    """The table on three runs of 100, 102, 104 s (losses 3.27, 3.275, 3.28) against three of
    103, 105, 107 s (losses 3.28, 3.285, 3.29)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.tmp.name
        self.groups = []
        for name, times, losses, ms in (("ours", (100, 102, 104), (3.27, 3.275, 3.28), (10, 20, 30, 40)),
                                        ("torch", (103, 105, 107), (3.28, 3.285, 3.29), (20, 20, 60, 60))):
            os.makedirs(os.path.join(d, name))
            for i, (t, loss) in enumerate(zip(times, losses)):
                # 8 steps: phases of 2 steps at ms[0..3] each, the last step padded to the run's time
                steps = [ms[0], ms[0], ms[1], ms[1], ms[2], ms[2], ms[3]]
                steps.append(t * 1000 - sum(steps))
                text = "\n".join(step_lines(steps, loss, 4))
                if name == "ours":
                    text = full_log(step_lines(steps, loss, 4))
                with open(os.path.join(d, name, f"run{i}.txt"), "w") as f:
                    f.write(text)
            self.groups.append(os.path.join(d, name))

    def tearDown(self):
        self.tmp.cleanup()

    def test_rows(self):
        groups = [logs.load_group(g) for g in self.groups]
        first = summarize.group_stats(*groups[0], 3.28)
        second = summarize.group_stats(*groups[1], 3.28, first)
        self.assertEqual(first["runs"], 3)
        self.assertAlmostEqual(first["time_mean"], 102.0)
        self.assertAlmostEqual(first["time_std"], 2.0)
        self.assertAlmostEqual(first["loss_mean"], 3.275)
        self.assertAlmostEqual(first["loss_std"], 0.005)
        self.assertAlmostEqual(first["loss_p"], 0.5 - math.sqrt(3 / 20), delta=1e-9)
        self.assertIsNone(first["time_p"])
        self.assertAlmostEqual(second["time_diff"], 3.0)
        self.assertAlmostEqual(second["loss_diff"], 0.01)
        self.assertAlmostEqual(second["time_p"], 0.1400660, delta=1e-6)
        # mean 3.285 > 3.28: t = +sqrt 3, p = 1 - 0.1127017
        self.assertAlmostEqual(second["loss_p"], 0.5 + math.sqrt(3 / 20), delta=1e-9)

    def test_output(self):
        out = io.StringIO()
        with redirect_stdout(out):
            rc = summarize.main(["ours=" + self.groups[0], self.groups[1], "--phases", "6:3,2"])
        text = out.getvalue()
        self.assertEqual(rc, 0)
        rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[2:-1]] for l in text.splitlines()
                if l.startswith("| ") and len(l.split("|")) == 12}
        self.assertEqual(rows["ours"][:8], ["3", "102.0000", "2.0000", "", "", "3.2750", "0.0050", ""])
        self.assertEqual(rows["ours"][8], "0.1127")
        self.assertEqual(rows["torch"][:8], ["3", "105.0000", "2.0000", "+3.0000", "0.1401", "3.2850", "0.0050", "+0.0100"])
        self.assertIn("ours: train_time (s) = [100.0000, 102.0000, 104.0000]", text)
        self.assertIn("ours: val_loss = [3.2700, 3.2750, 3.2800]", text)
        self.assertIn("torch: val_loss = [3.2800, 3.2850, 3.2900]", text)
        # the phase table: group, phase, steps, tokens, median ms/step, ratio
        phase_rows = [[c.strip() for c in l.split("|")[1:-1]] for l in text.splitlines()
                      if l.startswith("| ") and l.split("|")[2].strip().isdigit() and len(l.split("|")) == 8]
        self.assertEqual(phase_rows, [
            ["ours", "1", "1-2", "1000", "10.0000", ""],
            ["ours", "2", "3-4", "2000", "20.0000", ""],
            ["ours", "3", "5-6", "3000", "30.0000", ""],
            # 7-8: 40 ms and the padding of each run, pooled: the median of 40, 40, 40, 99840, ...
            ["ours", "4", "7-8", "3000", "49940.0000", ""],
            ["torch", "1", "1-2", "-", "20.0000", "2.0000"],
            ["torch", "2", "3-4", "-", "20.0000", "1.0000"],
            ["torch", "3", "5-6", "-", "60.0000", "2.0000"],
            ["torch", "4", "7-8", "-", "51400.0000", f"{51400 / 49940:.4f}"],
        ])

    def test_single_run(self):
        out = io.StringIO()
        with redirect_stdout(out):
            summarize.main([os.path.join(self.groups[0], "run0.txt")])
        row = [l for l in out.getvalue().splitlines() if l.startswith("| run0")][0]
        cells = [c.strip() for c in row.split("|")[1:-1]]
        self.assertEqual(cells, ["run0", "1", "100.0000", "-", "", "", "3.2700", "-", "", "-"])


class Plot(unittest.TestCase):
    def test_plot(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "a.txt")
            with open(log, "w") as f:
                f.write("\n".join(step_lines([5] * 8, 3.3, 4)) + "\n")
            png = os.path.join(d, "out.png")
            r = subprocess.run([sys.executable, os.path.join(HERE, "plot.py"), "-o", png, log],
                               capture_output=True, text=True)
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                self.assertEqual(r.returncode, 2)
                self.assertIn("pip install matplotlib", r.stderr)
                return
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class RecordFolders(unittest.TestCase):
    """Each record folder's README holds the tables that summarize.py makes from the folder's logs
    (pytorch/ first, then ours/), so a table pasted by hand or a log changed after the fact fails."""

    def test_readme_tables_match_the_logs(self):
        folders = sorted(d for d in os.listdir(HERE) if os.path.isdir(os.path.join(HERE, d, "ours")))
        self.assertTrue(folders, "no record folder")
        for name in folders:
            d = os.path.join(HERE, name)
            with open(os.path.join(d, "README.md")) as f:
                readme = f.read()
            groups = [logs.load_group(f"{g}={os.path.join(d, g)}") for g in ("pytorch", "ours")
                      if os.path.isdir(os.path.join(d, g))]
            phases = re.search(r"summarize\.py[^`\n]* --phases (\S+)", readme)  # as the README's command gives them
            spec = logs.parse_phases(phases.group(1)) if phases else None
            text = summarize.render(groups, 3.28, spec)
            tables = [t for t in text.split("\n\n") if t.startswith("| Group")]
            self.assertEqual(len(tables), 2)
            for t in tables:
                self.assertIn(t, readme, f"{name}/README.md: a table differs from summarize.py's")


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=1).result
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    sys.exit(1 if failed or not result.wasSuccessful() else 0)
