"""Power of the AQN equivalence test (results/aqn_equivalence/PLAN.md): how many paired seeds it needs.

The test is TOST (two one-sided paired t-tests, each at alpha) of |mean paired difference in final
pass@1| < margin. With n pairs whose differences are Normal(delta, sd^2), it declares equivalence iff
    -margin + t_c * s / sqrt(n) < mean < margin - t_c * s / sqrt(n),   t_c = t quantile 1 - alpha, n - 1 df,
so given the sample SD s the probability is a difference of two Normal CDFs, and the power is its average
over (n - 1) s^2 / sd^2 ~ chi-square(n - 1): computed here by quadrature (exact up to the grid), and
checked by simulating studies. The two-sided paired t-test's power comes the same way.

    python -m experiments.aqn_power                       # the plan's table (sd 0.076, margin 0.02, alpha 0.05)
    python -m experiments.aqn_power --sd 0.09 --power 0.9

No scipy: the t distribution comes from the regularized incomplete beta function of experiments.aqn_paired.
"""

from __future__ import annotations

import argparse
import math

from experiments.aqn_paired import betainc

SD = 0.076  # SD of the 16 paired differences in final pass@1 of results/aqn_paired/small (per_seed.csv)
MARGIN = 0.02
ALPHA = 0.05  # each one-sided test of TOST
POWER = 0.80


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q (bisection on ``t_cdf``)."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _chi_grid(df: int, points: int = 4000):
    """(x, weight) pairs of a quadrature of chi-square(df): the density on a grid over +-12 SD of x."""
    mean, sd = df, math.sqrt(2 * df)
    lo, hi = max(1e-9, mean - 12 * sd), mean + 12 * sd
    h = (hi - lo) / points
    logc = -(df / 2) * math.log(2) - math.lgamma(df / 2)
    xs = [lo + (i + 0.5) * h for i in range(points)]
    ws = [math.exp(logc + (df / 2 - 1) * math.log(x) - x / 2) * h for x in xs]
    total = sum(ws)
    return [(x, w / total) for x, w in zip(xs, ws)]


def tost_power(n: int, sd: float = SD, margin: float = MARGIN, alpha: float = ALPHA, delta: float = 0.0) -> float:
    """P(TOST declares |mean difference| < margin) with n pairs, true mean difference ``delta``."""
    if n < 2:
        return 0.0
    tc, se = t_quantile(1 - alpha, n - 1), sd / math.sqrt(n)
    p = 0.0
    for x, w in _chi_grid(n - 1):
        half = margin - tc * sd * math.sqrt(x / (n - 1)) / math.sqrt(n)  # margin - t_c * s / sqrt(n)
        if half > 0:
            p += w * (_phi((half - delta) / se) - _phi((-half - delta) / se))
    return p


def t_test_power(n: int, delta: float, sd: float = SD, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level alpha for a true mean difference ``delta``."""
    tc, se = t_quantile(1 - alpha / 2, n - 1), sd / math.sqrt(n)
    p = 0.0
    for x, w in _chi_grid(n - 1):
        half = tc * sd * math.sqrt(x / (n - 1)) / math.sqrt(n)
        p += w * (1 - (_phi((half - delta) / se) - _phi((-half - delta) / se)))
    return p


def pairs_needed(power: float = POWER, sd: float = SD, margin: float = MARGIN, alpha: float = ALPHA,
                 delta: float = 0.0) -> int:
    """The smallest n whose TOST power reaches ``power``."""
    n = 2
    while tost_power(n, sd, margin, alpha, delta) < power:
        n += 1
        if n > 100_000:
            raise ValueError("no n up to 100000 reaches that power")
    return n


def simulated_tost_power(n: int, sd: float = SD, margin: float = MARGIN, alpha: float = ALPHA, delta: float = 0.0,
                         studies: int = 20_000, seed: int = 0) -> float:
    """The same power by simulating ``studies`` studies of n Normal pairs (numpy, seeded)."""
    import numpy as np

    d = np.random.default_rng(seed).normal(delta, sd, (studies, n))
    m, s = d.mean(1), d.std(1, ddof=1)
    half = margin - t_quantile(1 - alpha, n - 1) * s / math.sqrt(n)
    return float(((m > -half) & (m < half)).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--sd", type=float, default=SD)
    ap.add_argument("--margin", type=float, default=MARGIN)
    ap.add_argument("--alpha", type=float, default=ALPHA)
    ap.add_argument("--power", type=float, default=POWER)
    args = ap.parse_args(argv)
    print(f"TOST, margin +-{args.margin}, alpha {args.alpha} each side, SD of the paired differences {args.sd}")
    for delta in (0.0, 0.005, 0.01):
        n = pairs_needed(args.power, args.sd, args.margin, args.alpha, delta)
        print(f"  true difference {delta:+.3f}: {n} pairs for power {args.power:.0%} "
              f"(simulated: {simulated_tost_power(n, args.sd, args.margin, args.alpha, delta):.3f})")
    for n in (100, 120, 128, 150, 200):
        print(f"  n = {n}: power {tost_power(n, args.sd, args.margin, args.alpha):.3f} at difference 0, "
              f"{tost_power(n, args.sd, args.margin, args.alpha, 0.005):.3f} at 0.005")
    for sd in (0.06, 0.09, 0.10):
        print(f"  SD {sd}: {pairs_needed(args.power, sd, args.margin, args.alpha)} pairs for power {args.power:.0%} "
              f"at difference 0")
    d16 = next(d / 10_000 for d in range(1, 2000) if t_test_power(16, d / 10_000, args.sd) >= 0.8)
    print(f"  the 16-pair study's two-sided t-test (alpha 0.05): 80% power from a difference of {d16:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
