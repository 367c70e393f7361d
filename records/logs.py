"""Reading the runs' logs (train_gpt's and the PyTorch record's alike) and the statistics of the
records' tables. Python 3 standard library only, so the tables can be made anywhere.

A log is the full source text, a line of 100 '=', versions, (ours) a configuration block between
`# configuration` and `# end configuration`, then one line per step:

    step:0/160 val_loss:10.7972 train_time:0ms step_avg:0.00ms
    step:1/160 train_time:204ms step_avg:204.13ms

A log may also hold the step lines only. Only whole lines of exactly that form count: the source
text above them contains the same words inside code lines.
"""
import glob
import math
import os
import re
from dataclasses import dataclass, field

STEP_RE = re.compile(r"^step:(\d+)/(\d+) (val_loss:([0-9.]+) )?train_time:(\d+)ms step_avg:([0-9.]+)ms$")
RULE = "=" * 100


class LogError(Exception):
    """A log or a group that cannot be read; the message names the file."""


@dataclass
class StepLine:
    step: int
    total: int
    val_loss: float | None  # None on a training step's line
    train_time_ms: int
    step_avg_ms: float


@dataclass
class Phase:
    index: int  # 0-based
    first: int  # step numbers of the log's lines (1-based: line k is training step k-1)
    last: int
    tokens: int | None  # tokens per step, where the configuration says

    @property
    def label(self):
        return f"{self.first}-{self.last}"


@dataclass
class Run:
    path: str
    steps: list
    config: dict = field(default_factory=dict)

    @property
    def final(self):
        """The final validation's line; a run without validation: its last line."""
        vals = [s for s in self.steps if s.val_loss is not None]
        return vals[-1] if vals else self.steps[-1]

    @property
    def time_s(self):
        return self.final.train_time_ms / 1000.0

    @property
    def loss(self):
        return self.final.val_loss

    @property
    def total(self):
        return self.steps[-1].total

    @property
    def finished(self):
        return self.steps[-1].step == self.total

    def validations(self):
        """(step, train_time in s, val_loss) of each validation."""
        return [(s.step, s.train_time_ms / 1000.0, s.val_loss) for s in self.steps if s.val_loss is not None]

    def step_times_ms(self):
        """{k: ms of training step line k}. The clock stops during validation and a validation line
        repeats the clock of the step before it, so step k's time is its train_time minus that of
        the last line of step k-1 (the first step: minus 0). The sum over the steps is the run's
        train_time."""
        out = {}
        prev_step, prev_time = 0, 0
        for s in self.steps:
            if s.val_loss is None and s.step == prev_step + 1:
                out[s.step] = s.train_time_ms - prev_time
            prev_step, prev_time = s.step, s.train_time_ms
        return out


def parse_text(text, path="<log>"):
    lines = text.splitlines()
    # Everything before the first rule is source text; a log of step lines only has no rule.
    start = lines.index(RULE) + 1 if RULE in lines else 0
    steps, config, in_config, config_done = [], {}, False, False
    for line in lines[start:]:
        if not config_done:
            if line == "# configuration":
                in_config = True
                continue
            if in_config:
                if line == "# end configuration":
                    in_config, config_done = False, True
                elif " = " in line:
                    key, value = line.split(" = ", 1)
                    config[key.strip()] = value.strip()
                continue
        m = STEP_RE.match(line)
        if m:
            steps.append(StepLine(int(m[1]), int(m[2]), float(m[4]) if m[3] else None, int(m[5]), float(m[6])))
    if not steps:
        raise LogError(f"{path}: no step lines (step:K/N [val_loss:X ]train_time:Tms step_avg:Ams)")
    return Run(path, steps, config)


def parse_log(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_text(f.read(), path)
    except OSError as e:
        raise LogError(f"{path}: {e.strerror}") from None


def split_group(spec):
    """`label=paths` or `paths` -> (label or None, [paths]); paths: a folder or comma-separated files."""
    label = None
    head, sep, tail = spec.partition("=")
    if sep and head and "/" not in head and "," not in head:
        label, spec = head, tail
    return label, [p for p in spec.split(",") if p]


def load_group(spec):
    """A GROUP argument -> (label, [Run]). A folder holds its *.txt logs (not recursive)."""
    label, paths = split_group(spec)
    if not paths:
        raise LogError(f"group '{spec}': no folder or log files given")
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(glob.escape(p), "*.txt")))
            if not found:
                raise LogError(f"{p}: no logs (*.txt) in this folder")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise LogError(f"{p}: no such file or folder")
    if label is None:
        if len(paths) == 1:
            p = os.path.normpath(paths[0])
            label = os.path.basename(p) if os.path.isdir(p) else os.path.splitext(os.path.basename(p))[0]
        else:
            parents = {os.path.basename(os.path.dirname(os.path.abspath(f))) for f in files}
            label = parents.pop() if len(parents) == 1 else spec
    return label, [parse_log(f) for f in files]


# ---- phases: the parts of the batch size schedule, then the extension steps


def parse_phases(text):
    """`150:3,10` -> (150 scheduled steps in 3 equal parts, 10 extension steps); `160` -> one phase."""
    m = re.fullmatch(r"(\d+)(?::(\d+))?(?:,(\d+))?", text.strip())
    if not m or int(m[1]) < 1 or (m[2] is not None and int(m[2]) < 1):
        raise ValueError(f"--phases '{text}': expected SCHEDULED[:PARTS][,EXTENSION], e.g. 150:3,10")
    return int(m[1]), int(m[2] or 1), int(m[3] or 0), None


def config_phases(config):
    """The phase spec the configuration block implies, or None where it has no schedule."""
    try:
        sched = int(config["num_scheduled_iterations"])
        ext = int(config.get("num_extension_iterations", "0"))
        bs = [int(x) for x in config["train_bs_schedule"].split(",")]
        tokens = bs + [int(config["train_bs_extension"]) if "train_bs_extension" in config else None]
    except (KeyError, ValueError):
        return None
    return sched, len(bs), ext, tokens


def run_phases(run, spec=None):
    """[Phase] of a run: from its configuration, else from `spec` (parse_phases) where given, else
    one phase of all its steps. Training step s (line s+1) is in part int(parts * s/scheduled), the
    trainer's get_bs formula, and the extension phase from s = scheduled on."""
    spec = config_phases(run.config) or spec
    if spec is None:
        return [Phase(0, 1, run.total, None)]
    sched, parts, ext, tokens = spec
    if sched + ext != run.total:
        raise LogError(f"{run.path}: {run.total} steps, but the phases cover {sched} + {ext}")
    phases = []
    for s in range(run.total):
        idx = parts if s >= sched else int(parts * (s / sched))
        if phases and phases[-1].index == idx:
            phases[-1].last = s + 1
        else:
            phases.append(Phase(idx, s + 1, s + 1, tokens[idx] if tokens else None))
    for i, p in enumerate(phases):
        p.index = i
    return phases


# ---- statistics: Student's t distribution from the regularized incomplete beta function


def mean(xs):
    return sum(xs) / len(xs)


def sample_std(xs):
    """Standard deviation with n-1 (None for fewer than two values)."""
    if len(xs) < 2:
        return None
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _betacf(a, b, x):
    """Continued fraction of the incomplete beta function, modified Lentz (Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    # converges in O(sqrt(max(a, b))) terms: a = nu/2 may be large
    for m in range(1, 100000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def betai(a, b, x):
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(ln_front)
    # the fraction converges fast on this side of the mean; the other side by symmetry
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t, nu):
    """P(T <= t) for Student's t with nu > 0 degrees of freedom (any real nu; inf: the normal)."""
    if math.isinf(nu):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    # P(|T| > |t|) = I_{nu/(nu+t^2)}(nu/2, 1/2)
    tail = 0.5 * betai(nu / 2.0, 0.5, nu / (nu + t * t))
    return 1.0 - tail if t > 0 else tail


def welch_t_test(a, b):
    """Two-sided Welch t-test of mean(a) != mean(b): (t, nu, p), or None where it is undefined
    (fewer than two values on a side, or no spread at all)."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = sample_std(a) ** 2 / len(a), sample_std(b) ** 2 / len(b)
    se2 = va + vb
    if se2 == 0:
        return None
    t = (mean(a) - mean(b)) / math.sqrt(se2)
    # Welch-Satterthwaite degrees of freedom
    nu = se2 * se2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    return t, nu, 2.0 * t_cdf(-abs(t), nu)


def t_test_less(xs, target):
    """One-sided one-sample t-test, H1: mean(xs) < target: (t, nu, p), or None where undefined."""
    s = sample_std(xs)
    if s is None or s == 0:
        return None
    t = (mean(xs) - target) / (s / math.sqrt(len(xs)))
    nu = len(xs) - 1
    return t, nu, t_cdf(t, nu)
