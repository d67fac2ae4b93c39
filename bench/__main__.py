"""Benchmarks: every speed claim of the project, measured side by side in one run and printed as ratios.
Speed lives here, never in the tests. Run from the repository root:

    python -m bench                           # the parts: tracker, throughput, logprobs, steps, sandbox, eval,
                                              # tools, collectives
    python -m bench tracker steps             # some of them (bench/parts.py, bench/throughput.py)
    python -m bench peer --trl_python PYTHON  # spo.py against TRL's GRPOTrainer (bench/peer.py; --task smollm)
    python -m bench gpu --part trainer        # the GPU device check (bench/gpu.py, bench/gpu_trainer.py):
                                              # --part trainer, loop, vllm

`python -m bench peer --help` and `python -m bench gpu --help` list their own flags.
"""
import sys


def main(argv):
    if argv[:1] == ["peer"]:
        from bench import peer
        return peer.main(argv[1:])
    if argv[:1] == ["gpu"]:
        from bench import gpu
        return gpu.main(argv[1:])
    from bench import parts
    return parts.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
