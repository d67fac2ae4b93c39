"""Benchmarks: every speed claim of the project, measured side by side in one run and printed as ratios.
Speed lives here, never in the tests. Run from the repository root:

    python -m bench [tracker steps ...]  # the parts, all or those named: tracker, steps, sandbox (bench/parts.py)
    python -m bench peer --trl_python P  # spo.py against TRL's GRPOTrainer (bench/peer.py; --task smollm)
    python -m bench throughput           # group-free throughput, paper Fig. 5, simulated (bench/throughput.py)
    python -m bench gpu --part trainer   # the GPU device check (bench/gpu.py, bench/gpu_trainer.py): trainer, loop
"""
import sys


def main(argv):
    if argv[:1] in (["peer"], ["throughput"], ["gpu"]):  # each with its own flags (--help)
        return __import__(f"bench.{argv[0]}", fromlist=["main"]).main(argv[1:])
    from bench import parts
    return parts.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
