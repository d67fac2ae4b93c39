"""`python -m bench throughput`: group-free throughput (paper section 4.4, Appendix B, Fig. 5), simulated in seconds.
SPO can train on the first B trajectories to finish and leave the long tail behind; a GRPO group is usable only when
its slowest member is done. The paper shows one simulated draw and publishes one group's times, not a distribution:
the trajectory times here are a lognormal mixture fitted to that group, its straggler share varied. (The real time
to a batch on the tool toy and the accuracy cost of over-sampling are not here: docs/benchmarks.md, at 6509b6c.)
"""
import argparse

import numpy as np

PAPER_GROUP_S = (74, 87, 90, 114, 117, 409, 444, 508)  # the one group of 8 the paper's Fig. 5 shows (s)


def trajectory_times(rng, shape, straggler_share, fast=(95.0, 0.19), slow=(451.0, 0.11)):
    """Seconds per trajectory: the two-part lognormal mixture fitted to PAPER_GROUP_S (fast, slow: median and sd of
    log; stragglers 3/8 there), the stragglers' share given."""
    straggler = rng.random(shape) < straggler_share
    return np.where(straggler, rng.lognormal(np.log(slow[0]), slow[1], shape),
                    rng.lognormal(np.log(fast[0]), fast[1], shape))


def time_to_batch(times, keep, group_size):
    """(S,) seconds until `keep` usable trajectories exist, for times (S, N) of N trajectories started at once.
    group_size 1 (SPO): the keep-th fastest trajectory. G > 1: trajectories n*G..n*G+G-1 form a group, usable
    when its slowest member is done; the (keep / G)-th fastest group."""
    done = times if group_size == 1 else times.reshape(len(times), -1, group_size).max(-1)  # (S, N / G)
    return np.sort(done, axis=1)[:, keep // group_size - 1]


def simulate(rng, seeds=10_000, keep=24, group_size=8, shares=(0.05, 0.125, 0.25, 0.375, 0.5), thirds=(3, 4, 5, 6, 9)):
    """{straggler share: {trajectories started: (seeds,) time ratio GRPO / SPO}}: SPO keeps the first `keep` single
    trajectories to finish, GRPO the first keep / G complete groups; started: `thirds` of keep, in whole groups."""
    return {share: {n: time_to_batch(times, keep, group_size) / time_to_batch(times, keep, 1)
                    for n in (keep * f // 3 // group_size * group_size for f in thirds)
                    for times in [trajectory_times(rng, (seeds, n), share)]} for share in shares}


def main(argv=None, seeds=10_000, keep=24, group_size=8):
    """Prints the ratio's mean and 95% interval by straggler share and f = started / kept (the paper: f = 2)."""
    argparse.ArgumentParser(prog="python -m bench throughput", description=__doc__.split("\n")[0]).parse_args(argv)
    rng = np.random.default_rng(0)
    ratios = simulate(rng, seeds, keep, group_size)
    print(f"Fig. 5 as a simulation: {keep} trajectories kept, G = {group_size}; the ratio GRPO time / SPO time over "
          f"{seeds} draws (mean [2.5%, 97.5%]); trajectory times: the mixture fitted to the published group")
    print(f"{'straggler share':>16} " + " ".join(f"{f'f = {n}/{keep}':>22}" for n in next(iter(ratios.values()))))
    for share, row in ratios.items():
        cells = [(r.mean(), *np.percentile(r, [2.5, 97.5])) for r in row.values()]
        print(f"{share:>16.3f} " + " ".join(f"{f'{m:5.2f} [{lo:4.2f}, {hi:5.2f}]':>22}" for m, lo, hi in cells))
    paper, times = ratios[3 / 8][2 * keep], trajectory_times(rng, (seeds, 2 * keep), 3 / 8)
    grpo, spo = (np.median(time_to_batch(times, keep, g)) for g in (group_size, 1))
    print(f"at the published group's share (3/8) and f = 2: GRPO {grpo:.0f} s vs SPO {spo:.0f} s (medians), ratio "
          f"{paper.mean():.2f} [{np.percentile(paper, 2.5):.2f}, {np.percentile(paper, 97.5):.2f}]; the paper's one "
          f"draw: 486 s vs 112 s, 4.35x", flush=True)
    return ratios
