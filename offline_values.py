"""The command that measures offline value estimates v0 (Algorithm 2, Eq. 6) for SPO's tracker: n0 samples per
training prompt from the initial policy, scored as training scores them (initial_values.py). Use the same
--max_prompt_len as training: spo.py refuses a file with prompts its training set left out.

    torchrun --nproc_per_node=2 offline_values.py --model M --data train.parquet --out values.json
    python offline_values.py                                   # the built-in toy, one process
"""
import argparse
import os

from hf_engine import add_engine_flags, start_engine, start_program
from initial_values import estimate_offline_values, read_finished, run_header
from machinery.run_dir import open_output
from reward import add_reward_flags, check_reward_flag
from rollout import TOOL_INSTRUCTION, add_budget_flag, add_tool_flags, make_tools, response_budget


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Offline value estimates v0 for SPO's tracker (Algorithm 2)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="the INITIAL policy: HF model name or dir (default: the toy)")
    g.add_argument("--data", default=None, help="training prompts, parquet or JSONL (default: the toy's)")
    g.add_argument("--toy_dir", default=None,
                   help="the built-in toy's directory (default: the shipped tasks/built/toy, toy_tools with --tools)")
    g.add_argument("--out", default="offline_values.json", help="output JSON (partial files go next to it)")
    g.add_argument("--max_prompt_len", type=int, default=256, help="as in training: longer prompts are left out")
    g.add_argument("--max_prompts", type=int, default=0, help="only the first N prompts (0: all)")
    g = p.add_argument_group("sampling (defaults: training's)")
    g.add_argument("--n0", type=int, default=8, help="samples per prompt (paper: 8)")
    g.add_argument("--temperature", type=float, default=1.0, help="as training samples (the authors used 0.6)")
    g.add_argument("--top_p", type=float, default=1.0, help="as training samples")
    add_budget_flag(g)  # --max_response_len (alias --max_tokens): as training's
    add_reward_flags(g)  # --reward, --truncated_reward, --think_format: as training's
    g.add_argument("--seed", type=int, default=0, help="per-request seeds derive from (seed, prompt key, sample)")
    g = p.add_argument_group("run and engine")
    g.add_argument("--chunk_prompts", type=int, default=64, help="prompts per generate call and partial flush")
    g.add_argument("--max_chunks", type=int, default=None, help="debugging: stop after N chunks per rank")
    add_engine_flags(g, gpu_share=0.9)  # --engine, --gpu_memory_utilization (an engine alone), --compile
    add_tool_flags(p)
    args = p.parse_args(argv)
    args.max_response_len = response_budget(args.max_response_len, args.tools)
    if args.n0 < 1 or args.max_response_len < 1 or args.chunk_prompts < 1:
        p.error("--n0, --max_response_len (--max_tokens) and --chunk_prompts must be at least 1")
    from machinery.errors import check_finite, check_sampling, fail
    check_finite(vars(args))
    check_sampling(args.temperature, args.top_p, -1)
    check_reward_flag(args.reward, args.reward_timeout)
    for flag, low, note in (("seed", 0, ""), ("max_prompts", 0, " (0: all)"), ("max_chunks", 1, ""),
                             ("max_prompt_len", 1, "")):  # here, not where first used (after the engine)
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            fail(f"--{flag} must be at least {low}{note}, got {getattr(args, flag)}", once=True)
    if not 0 < args.gpu_memory_utilization <= 1:
        fail(f"--gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}", once=True)
    return args


def main(argv=None):
    from machinery.data import check_context, find_model, load_dataset, load_tokenizer
    from machinery.errors import fail
    from tasks import toy
    args = parse_args(argv)
    rank, world, device, args.engine = start_program(args.engine)  # as spo.py
    args.toy_dir, args.model, args.data, _ = toy.fill_in(args.toy_dir, args.tools, args.model, args.data, "train")
    args.model = find_model(args.model)  # a hub name without a hub: its cached copy, or one line
    sampling = {k: getattr(args, k) for k in ("n0", "temperature", "top_p", "seed", "truncated_reward", "think_format",
                                              "reward")}
    sampling["max_tokens"] = args.max_response_len  # the header's name for the budget
    # Paths as absolute so that a rerun from another directory still matches the partial files' header.
    header = {k: os.path.abspath(v) if os.path.exists(v) else v for k, v in (("model", args.model),
                                                                             ("dataset", args.data))}
    if args.tool_instruction:
        header["system_prompt"] = TOOL_INSTRUCTION
    tools = make_tools(args.tools, args.max_turns, args.sandbox_workers, args.sandbox_timeout, args.sandbox_memory_mb,
                       args.max_tool_output_chars, {args.data: "data", args.out: "out"})
    # one pass per --out at a time (two would append to the same partial files); its own output it resumes from
    open_output(args.out, "--out", "offline_values.py")
    try:
        # a settings mismatch fails here, before the engine starts
        read_finished(args.out, run_header(header, **sampling, tools=tools))
    except ValueError as e:
        fail(str(e))
    tokenizer = load_tokenizer(args.model)
    check_context(args.model, args.max_prompt_len + args.max_response_len, "--max_prompt_len + --max_response_len")
    data = load_dataset(args.data, tokenizer, args.max_prompt_len, rank == 0, header.get("system_prompt"))
    if args.max_prompts:
        data = data[: args.max_prompts]
    engine = start_engine(args.engine, args.model, seed=args.seed, device=device, temperature=args.temperature,
                          max_model_len=args.max_prompt_len + args.max_response_len,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          engine_compile=args.compile)
    estimate_offline_values(engine, data, args.out, header=header, chunk_prompts=args.chunk_prompts,
                            max_chunks=args.max_chunks, tools=tools, reward_timeout=args.reward_timeout, **sampling)
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
