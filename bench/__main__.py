"""Benchmarks: every speed claim of the project, measured side by side in one run and printed as ratios.
Speed lives here, never in the tests. Run from the repository root:

    python -m bench                      # the parts: tracker, steps, sandbox (bench/parts.py)
    python -m bench tracker steps        # some of them
    python -m bench gpu --part trainer   # the GPU device check (bench/gpu.py, bench/gpu_trainer.py): trainer, loop
"""
import sys


def main(argv):
    if argv[:1] == ["gpu"]:
        from bench import gpu
        return gpu.main(argv[1:])
    from bench import parts
    return parts.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
