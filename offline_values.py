"""Algorithm 2 (Eq. 6): the tracker's initial values v0, measured (n0 samples per training prompt from the initial
policy, scored as training scores them), written, checked and read; spo.py reads them (TrainingV0, init_tracker),
and the command at the bottom measures them. Use the same --max_prompt_len as training: spo.py refuses a file with
prompts its training set left out.

Sampling is by default exactly training's (temperature 1.0, top_p 1.0, the training budget, reward and tool loop):
the authors measured v0 at their evaluation temperature 0.6 while training at 1.0, a prior for another
distribution. The settings that change v0 join the file's header, and spo.py refuses a mismatch. Every request's
seed derives from (seed, prompt key, sample index), so a pass resumes from its partial files whatever the world
size (docs/evaluation.md). The file (dataset order; scores: the n0 rewards):
    {"header": {"model", "dataset", "n0", "temperature", "top_p", "max_tokens", "seed", ...},
     "prompts": {prompt key: {"prompt": decoded prompt text, "scores": [0.0, 1.0, ...]}}}

    torchrun --nproc_per_node=2 offline_values.py --model M --data train.parquet --out values.json
    python offline_values.py                                   # the built-in toy, one process
"""
import argparse
import contextlib
import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch.distributed as dist

from hf_engine import add_engine_flags, start_engine
from machinery import collectives
from machinery.device import start_program
from machinery.errors import fail
from machinery.run_dir import atomic_write, open_output, shared_output
from machinery.untrusted import parse_json, read_file, read_json
from probes import check_sampling_flags, request_seeds
from reward import DEFAULT_REWARD, VERIFIER_TIMEOUT_S, add_reward_flags, rewards
from rollout import TOOL_INSTRUCTION, add_budget_flag, add_tool_flags, make_tools, response_budget


def run_header(header, *, n0, temperature, top_p, max_tokens, seed, truncated_reward, tools=None,
               think_format=False, reward=DEFAULT_REWARD):
    """The settings that make scores comparable."""
    header = {**header, "n0": n0, "temperature": float(temperature), "top_p": float(top_p),
              "max_tokens": max_tokens, "seed": seed, "truncated_reward": truncated_reward}
    # Absent when off (or the default verifier), so that files made before these options existed still match.
    if tools is not None:
        header["tools"] = tool_settings(tools)
    if think_format:
        header["think_format"] = True
    return {**header, **reward_setting(reward)}


def reward_setting(reward):
    """{"reward": spec} for a --reward other than the default, else {}: the default is what every file made
    before --reward existed used, and the toy's cached values keep their name (toy_values_path hashes these)."""
    return {} if reward == DEFAULT_REWARD else {"reward": reward}


def tool_settings(tools):
    """The tool-loop settings that change what a sample can do (recorded in the header), or None."""
    return None if tools is None else {"max_turns": tools.max_turns,
                                       "max_tool_output_chars": tools.max_tool_output_chars,
                                       "show_last_expression": tools.show_last_expression}


# The header entries that change v0, and their values when absent from a file (or from the run's settings).
V0_SETTINGS = {"temperature": None, "top_p": None, "max_tokens": None, "truncated_reward": "zero",
               "think_format": False, "tools": None, "system_prompt": None, "reward": DEFAULT_REWARD}


@dataclass(frozen=True)
class TrainingV0:
    """spo.py's run as Algorithm 2 reads it, built once at its start from its flags (named as them)."""
    offline_values: str  # a values file, 'auto' (on the toy: measured here once, then cached) or 'none'
    n0: int
    seed: int
    init_smoothing: str
    model: str
    train: str
    toy_dir: str
    train_prompts: int
    pool_seed: int
    temperature: float
    max_response_len: int
    truncated_reward: str
    think_format: bool
    reward: str
    reward_timeout: float
    tools: object = None  # a rollout.Tools, or None
    system_prompt: str | None = None

    @classmethod
    def pick(cls, flags: dict, tools=None, system_prompt=None):
        named = {f.name: flags[f.name] for f in fields(cls) if f.name not in ("tools", "system_prompt")}
        return cls(**named, tools=tools, system_prompt=system_prompt)

    def settings(self):
        """The settings of the run that change v0 (training samples at top_p 1)."""
        return {"temperature": float(self.temperature), "top_p": 1.0, "max_tokens": self.max_response_len,
                "truncated_reward": self.truncated_reward, "think_format": self.think_format,
                "tools": tool_settings(self.tools), "system_prompt": self.system_prompt, **reward_setting(self.reward)}


VALUES_FILE = {"header": dict, "prompts": {str: {"scores": [float]}}}  # an offline-values file's shape


def read_values_file(path):
    """(header, prompts) of an offline-values file; another shape is one line naming it and what is wrong."""
    try:
        saved = read_json(path, VALUES_FILE)
    except (OSError, ValueError) as e:
        fail(f"--offline_values {path}: not an offline-values file ({e}; offline_values.py writes them)")
    return saved["header"], saved["prompts"]


def check_values_header(path, wanted, accept_mismatch=False, model=None):
    """The V0_SETTINGS an offline-values file was made with (and its model) against `wanted`, the training run's.
    A mismatch is an error naming each setting and both values, unless accept_mismatch (then a warning): the
    tracker would start from values measured under another distribution than training's."""
    header, _ = read_values_file(path)
    diff = [f"{k}: {header.get(k, absent)!r} there, {wanted.get(k, absent)!r} here"
            for k, absent in V0_SETTINGS.items() if header.get(k, absent) != wanted.get(k, absent)]
    if model is not None and header.get("model") is not None and same_model(header["model"]) != same_model(model):
        diff.append(f"model: {header['model']!r} there, {model!r} here")
    if not diff:
        return
    message = f"--offline_values {path} was made with other settings than this run ({'; '.join(diff)})"
    if not accept_mismatch:
        fail(message + ": remake it with offline_values.py and this run's settings, or pass "
                       "--accept_offline_mismatch to start from it anyway")
    print(f"warning: {message}; used anyway (--accept_offline_mismatch)", flush=True)


def same_model(name):
    """The real path of a folder (however it was reached), else the hub name."""
    return os.path.realpath(name) if os.path.exists(name) else name


def partial_paths(out_path):
    """Partial files of earlier runs, of any world size."""
    return sorted(glob.glob(glob.escape(out_path) + ".rank*.partial.jsonl"))


def read_finished(out_path, header):
    """{prompt key: scores} already in out_path and its partial files; ValueError if made with other settings."""
    done = {}
    for path in ([out_path] if os.path.exists(out_path) else []) + partial_paths(out_path):
        try:
            if path == out_path:
                saved = read_json(path, VALUES_FILE)
                theirs, entries = saved["header"], {key: e["scores"] for key, e in saved["prompts"].items()}
            else:
                lines = read_file(path).split(b"\n")
                theirs, entries = parse_json(lines[0], {"header": dict})["header"], {}
                for line in lines[1:]:
                    with contextlib.suppress(ValueError):  # an empty line or one a crash cut off: its prompt is redone
                        row = parse_json(line, {"key": str, "scores": [float]})
                        entries[row["key"]] = row["scores"]
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not an offline-values file ({e}); move it away or choose another --out") \
                from None
        theirs = {k: v for k, v in theirs.items() if k != "created"}
        if theirs != header:
            diff = "; ".join(f"{k}: {theirs.get(k)!r} there, {header.get(k)!r} now" for k in sorted({*theirs, *header})
                             if theirs.get(k) != header.get(k))
            raise ValueError(f"{path} was made with other settings ({diff}): rerun with the same settings to "
                             f"resume, or delete it / choose another --out to start over")
        done.update(entries)
    return done


def estimate_offline_values(engine, data, out_path, *, n0=8, temperature=1.0, top_p=1.0, max_tokens, seed=0,
                            header, truncated_reward="zero", chunk_prompts=64, progress=True, max_chunks=None,
                            tools=None, think_format=False, reward=DEFAULT_REWARD, reward_timeout=VERIFIER_TIMEOUT_S):
    """n0 scored samples of every prompt of `data`, sharded over ranks, resumable; call on every rank. Rank 0 writes
    out_path once all prompts are done (max_chunks can stop a run earlier: a debugging aid)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    barrier = collectives.barrier if world > 1 else (lambda: None)  # a rank stopped by its verifier: one line each
    header = run_header(header, n0=n0, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                        truncated_reward=truncated_reward, tools=tools, think_format=think_format, reward=reward)
    done = read_finished(out_path, header)
    barrier()  # every rank has read the files before any rank appends to them
    todo = [p for p in range(rank, len(data.keys), world) if data.keys[p] not in done]
    partial = f"{out_path}.rank{rank}.partial.jsonl"
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm
        print(f"offline values: {len(data.keys)} prompts, {len(done)} already done, n0 = {n0}", flush=True)
        # counts samples as each finishes (engine.generate's progress), not chunks: a chunk can take minutes
        bar = tqdm(total=len(todo) * n0, desc=f"offline values (rank 0 of {world})", unit="sample", dynamic_ncols=True)
    new, kept = not os.path.exists(partial), False  # kept: a whole prompt of this run is in the partial file
    try:
        with open(partial, "a") as f:
            if f.tell() == 0:
                f.write(json.dumps({"header": {**header, "created": time.strftime("%Y-%m-%d %H:%M:%S")}}) + "\n")
            else:
                f.write("\n")  # ends a line a crash may have cut off; blank lines are skipped when read
            for c in range(0, len(todo), chunk_prompts):
                if max_chunks is not None and c >= max_chunks * chunk_prompts:
                    break
                chunk = todo[c: c + chunk_prompts]
                seeds = np.concatenate([request_seeds(seed, data.keys[p], n0) for p in chunk])  # (len(chunk) * n0,)
                rollouts = engine.generate([data.prompt_ids[p] for p in chunk for _ in range(n0)], seeds,
                                           max_tokens=max_tokens, temperature=temperature, top_p=top_p, tools=tools,
                                           **({"progress": bar.update} if bar is not None else {}))
                scores = rewards(rollouts, [data.answers[p] for p in chunk for _ in range(n0)], think_format,
                                 truncated_reward, reward, reward_timeout).reshape(len(chunk), n0)
                f.writelines(json.dumps({"key": data.keys[p], "scores": s.tolist()}) + "\n"
                             for p, s in zip(chunk, scores))
                f.flush()
                os.fsync(f.fileno())
                kept = True
    except OSError as e:
        if new and not kept and os.path.exists(partial):
            os.remove(partial)  # a header, perhaps cut off, and nothing else: a rerun starts as if it never ran
        stop_on_full_disk(e, partial)
    if bar is not None:
        bar.close()
    barrier()
    # each rank's shard as its node sees it, to rank 0 by a collective: the partial files need no shared filesystem
    shard = set(data.keys[rank::world])
    done = {k: v for k, v in read_finished(out_path, header).items() if k in shard}
    done = {k: v for part in collectives.all_gather_objects([done]) for k, v in part.items()} if world > 1 else done
    if rank == 0:
        missing = sum(key not in done for key in data.keys)
        if missing:
            print(f"offline values: stopped with {missing} prompts to go; rerun the same command to resume", flush=True)
        else:
            result = {"header": {**header, "created": time.strftime("%Y-%m-%d %H:%M:%S")},
                      "prompts": {key: {"prompt": engine.tokenizer.decode(ids), "scores": done[key]}
                                  for key, ids in zip(data.keys, data.prompt_ids)}}
            try:
                with atomic_write(out_path) as f:  # a crash never leaves a half-written values file
                    json.dump(result, f)
            except OSError as e:
                stop_on_full_disk(e, out_path)
            for path in partial_paths(out_path):
                os.remove(path)
            if progress:
                print_histogram(result, n0)
    # (also the barrier: the values file is written before any rank reads it)
    finished = collectives.all_gather_objects([not missing if rank == 0 else None])[0] if world > 1 else not missing
    if finished:  # (a node of its own keeps its partial file until the values file is whole)
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


def stop_on_full_disk(error, path):
    """A full disk or quota while writing `path`: one line, not a traceback (the prompts finished stay in the
    partial files: the same command resumes once there is room). Any other error is not this one's to name."""
    import errno
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise error
    fail(f"{path}: {error.strerror} while writing the offline values; the prompts finished so far are kept: free "
         f"space and rerun the same command to resume")


def claim_toy_values(run: TrainingV0, on_toy, run_dir):
    """spo.py's --offline_values settled before the engine starts: on the toy, 'auto' becomes the file of the toy's v0
    for the run's settings, beside the toy or, where this run cannot claim it, in its run directory."""
    if not (on_toy and run.offline_values == "auto"):
        return run
    path = toy_values_path(run.toy_dir, run.n0, run.seed, run.settings(), run.train_prompts, run.pool_seed)
    return replace(run, offline_values=shared_output(path, run_dir, "spo.py", "the toy's offline values"))


def shipped_name(path):
    """A shipped toy's file by its place in the repository (a header that reads the same in every clone)."""
    from tasks.toy import BUILT
    return os.path.relpath(path, os.path.dirname(os.path.dirname(BUILT))) if path.startswith(BUILT + os.sep) else path


def init_tracker(tracker, run: TrainingV0, engine, data, on_toy, is_main):
    """spo.py's Algorithm 2: the tracker from --offline_values (on the toy, measured once where claim_toy_values put
    it, with the run's own engine and settings: they match by construction), or the uninformed prior."""
    path = run.offline_values  # (on the toy, "auto" is settled by then: claim_toy_values)
    if on_toy and path != "none" and not os.path.exists(path):
        estimate_offline_values(engine, data, path, n0=run.n0, temperature=run.temperature,
                                max_tokens=run.max_response_len, seed=run.seed,
                                header={"model": shipped_name(run.model), "dataset": shipped_name(run.train),
                                        **({"system_prompt": run.system_prompt} if run.system_prompt else {})},
                                truncated_reward=run.truncated_reward, progress=is_main, tools=run.tools,
                                think_format=run.think_format, reward=run.reward, reward_timeout=run.reward_timeout)
    if path not in ("auto", "none"):
        init_tracker_from_file(tracker, path, data, run.init_smoothing, is_main)
    elif is_main:
        print("no --offline_values: the tracker starts from the uninformed prior (make them with offline_values.py)",
              flush=True)


def add_v0_flags(p):
    """spo.py's flags for the tracker's initial values v0 (Algorithm 2)."""
    p.add_argument("--offline_values", default="auto", help="the tracker's v0: a file offline_values.py wrote; "
                   "'auto': on the toy measured on first use, else none; 'none': the uninformed prior")
    p.add_argument("--n0", type=int, default=8, help="offline samples per prompt when v0 is built by spo.py")
    p.add_argument("--accept_offline_mismatch", action="store_true", help="use a v0 file made with other settings")
    p.add_argument("--init_smoothing", choices=["kt", "mean"], default="kt", help="v0 from s successes of n "
                   "samples: (s+0.5)/(n+1) (kt, the authors') or s/n (mean, the paper's)")


def toy_values_path(toy_dir, n0, seed, v0_settings, train_prompts=0, pool_seed=-1):
    """Where the toy's offline values for these settings (and --train_prompts subset) are cached."""
    digest = hashlib.sha1(json.dumps(v0_settings, sort_keys=True).encode()).hexdigest()[:8]
    subset = (f"_p{train_prompts}" + (f"d{pool_seed}" if pool_seed >= 0 else "")) if train_prompts else ""
    name = f"offline_values_n{n0}_seed{seed}_len{v0_settings['max_tokens']}{subset}_{digest}.json"
    return os.path.join(toy_dir, name)


def init_tracker_from_file(tracker, path, data, smoothing, verbose):
    """Algorithm 2: the tracker from a values file; a bad one, or one for another dataset, stops with one line."""
    # read by rank 0 and sent to the others: a values file spo.py made on the toy is on rank 0's node only
    many = dist.is_initialized() and dist.get_world_size() > 1
    entries = read_values_file(path)[1] if not many or dist.get_rank() == 0 else None
    entries = collectives.all_gather_objects([entries])[0] if many else entries
    position = {key: i for i, key in enumerate(data.keys)}
    if unknown := [key for key in entries if key not in position]:
        fail(f"--offline_values {path}: {len(unknown)} of its {len(entries)} prompt keys are not in the training "
             f"set (e.g. {unknown[0]}): was it made for another dataset?")
    index = np.array([position[key] for key in entries], dtype=np.int64)
    try:
        scores = [np.asarray(e["scores"], dtype=np.float64).reshape(-1) for e in entries.values()]
    except (KeyError, TypeError, ValueError) as e:
        fail(f"--offline_values {path}: a prompt's \"scores\" is not a list of numbers ({e.__class__.__name__}: {e})")
    bad = next((key for key, s in zip(entries, scores) if not s.size or ((s != 0) & (s != 1)).any()), None)
    if bad is not None:
        fail(f"--offline_values {path}: prompt {bad} has scores {entries[bad]['scores']!r}; each must be a non-empty "
             f"list of 0/1 rewards")
    tracker.init_from_scores(index, np.array([s.sum() for s in scores]), np.array([s.size for s in scores]),
                             smoothing=smoothing)
    if verbose and len(index) < len(data.keys):
        print(f"--offline_values: {len(data.keys) - len(index)} training prompts have no offline scores and "
              f"start from the uninformed prior", flush=True)


def print_histogram(result, n0):
    """How many prompts the initial model solves k of n0 times (one line): the spread SPO's sampler feeds on."""
    successes = np.array([round(sum(e["scores"])) for e in result["prompts"].values()])  # (P,)
    counts = np.bincount(successes, minlength=n0 + 1)
    print(f"v0 over {len(successes)} prompts: mean {successes.mean() / n0:.3f}; prompts solved k of {n0} times: "
          + ", ".join(f"{k}: {c}" for k, c in enumerate(counts)), flush=True)


# ------------------------------------------------------------------------------------------------ the command
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Offline value estimates v0 for SPO's tracker (Algorithm 2)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="the INITIAL policy: HF model name or dir (default: the toy)")
    g.add_argument("--data", default=None, help="training prompts: parquet or JSONL, or a hub dataset "
                   "owner/name[:config][@split] (default: the toy's)")
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
    check_sampling_flags(vars(args), {"seed": 0, "max_prompts": 0, "max_chunks": 1, "max_prompt_len": 1})
    return args


def main(argv=None):
    from machinery.data import check_context, find_model, load_dataset, load_tokenizer
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
    data = load_dataset(args.data, tokenizer, args.max_prompt_len, rank == 0,
                        header.get("system_prompt"))[: args.max_prompts or None]
    engine = start_engine(args.engine, args.model, seed=args.seed, device=device, temperature=args.temperature,
                          max_model_len=args.max_prompt_len + args.max_response_len,
                          gpu_memory_utilization=args.gpu_memory_utilization, engine_compile=args.compile)
    estimate_offline_values(engine, data, args.out, header=header, chunk_prompts=args.chunk_prompts,
                            max_chunks=args.max_chunks, tools=tools, reward_timeout=args.reward_timeout, **sampling)
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
