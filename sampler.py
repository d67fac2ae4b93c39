"""Prioritized prompt sampling for SPO: draw B distinct prompts, favouring those whose outcome is uncertain.

Paper (Xu & Ding, ICLR 2026), Eq. 11 with the ICLR version's N_eff^gamma term:
    w(x) = sqrt(v(x) (1 - v(x))) / N_eff(x)^gamma + eps,     eps = 0.05, gamma in [0, 1] (0 = arXiv form)
The first term is the Bernoulli standard deviation (prompts neither always solved nor never solved);
eps keeps every prompt reachable (no curriculum collapse); N_eff^gamma favours prompts the tracker knows less.
Once per step (Algorithm 1) B prompts are drawn without replacement proportional to w ("successive sampling",
the law of numpy's choice(replace=False, p=w/sum(w))), exactly, by Gumbel-top-k: the B largest log w + Gumbel
noise. The largest key is i's with probability w_i / sum(w) (Gumbel-max) and the others stay independent
Gumbel-perturbed keys, so the keys' order is a Plackett-Luce draw, which is successive sampling. A draw costs O(n).

Usage (in spo.py): set_weights(priority_weights(tracker.value, tracker.n_eff)) once, then each step
    index = sampler.draw(B)  ...  tracker.update(index, reward, rho)
    sampler.set_weights(priority_weights(tracker.value_at(index), tracker.n_eff_at(index)), index)
"""
import numpy as np


def priority_weights(value, n_eff, eps=0.05, gamma=0.0):
    """Eq. 11: sqrt(v(1-v)) / n_eff**gamma + eps, vectorised. v is clipped into [0, 1] first: the Eq. 7
    EMA of rewards outside [0, 1] can leave it, and sqrt of a negative number would be NaN."""
    v = np.clip(np.asarray(value, dtype=np.float64), 0.0, 1.0)
    spread = np.sqrt(v * (1.0 - v))
    if gamma != 0:
        spread = spread / np.asarray(n_eff, dtype=np.float64) ** gamma
    return spread + eps


class PromptSampler:
    """Seeded sampling of B distinct prompts: Gumbel-top-k on the weights, or uniform (mode="uniform")."""

    def __init__(self, n_prompts, seed, mode="prioritized"):
        if int(n_prompts) != n_prompts or n_prompts < 1:
            raise ValueError(f"sampler: n_prompts must be a positive integer, got {n_prompts!r}")
        self.n_prompts, self.mode = int(n_prompts), mode
        self.rng = np.random.default_rng(seed)
        self._weights = np.ones(self.n_prompts) if mode == "prioritized" else None  # uniform until set

    def set_weights(self, weights, index=None):
        """All weights (index=None, shape (n,)), or only those of `index` (distinct indices, shape (B,)).
        Ignored in uniform mode."""
        if self.mode == "uniform":
            return
        weights = np.asarray(weights, dtype=np.float64)
        if index is None and weights.shape != (self.n_prompts,):
            raise ValueError(f"sampler.set_weights: expected {self.n_prompts} weights, got shape {weights.shape}")
        if not np.isfinite(weights).all() or (weights < 0).any():
            raise ValueError("sampler.set_weights: weights must be finite and >= 0")
        if index is None:
            self._weights = weights.copy()
            return
        index = np.asarray(index)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer) or weights.shape != index.shape:
            raise ValueError(f"sampler.set_weights: index must be 1-D integers matching weights, got "
                             f"{index.dtype} {index.shape} and weights {weights.shape}")
        if index.size and (index.min() < 0 or index.max() >= self.n_prompts):
            raise ValueError(f"sampler.set_weights: index out of range [0, {self.n_prompts})")
        if len(np.unique(index)) != len(index):
            raise ValueError("sampler.set_weights: index has repeated prompts (which weight would win?)")
        self._weights[index] = weights

    @property
    def weights(self):  # (n,) current weights (the live array, not a copy), None in uniform mode
        return self._weights

    def draw(self, batch_size):
        """(B,) int64 distinct prompt indices, in random order."""
        if int(batch_size) != batch_size or not 1 <= batch_size <= self.n_prompts:
            raise ValueError(f"sampler.draw: batch_size must be in [1, {self.n_prompts}], got {batch_size}")
        k, n = int(batch_size), self.n_prompts
        if self.mode == "uniform":
            return self.rng.choice(n, size=k, replace=False).astype(np.int64)
        if not self._weights.sum() > 0:
            raise ValueError("sampler.draw: all prompt weights are 0")
        # Keys w / E, E ~ Exp(1), are exp(log w + G) with G = -log E standard Gumbel: the same order, no logs.
        noise = np.maximum(self.rng.standard_exponential(n), np.finfo(np.float64).tiny)  # (n,), never 0
        keys = np.divide(self._weights, noise, out=noise)  # (n,), 0 where w = 0
        top = np.argpartition(keys, n - k)[n - k:] if k < n else np.arange(n)  # (k,) the k largest keys
        if not (keys[top] > 0).all():
            raise ValueError(f"sampler.draw: fewer prompts with weight > 0 than the batch size "
                             f"({np.count_nonzero(self._weights)} < {k})")
        # In random order: argpartition's order follows the keys and indices, not chance, and callers slice the
        # batch across ranks and PPO mini-batches (sorted by key, one rank would get the most uncertain prompts).
        return self.rng.permutation(top.astype(np.int64))

    def state_dict(self):
        """The RNG state only. Weights are a function of the tracker: after load_state_dict, call
        set_weights(priority_weights(tracker.value, tracker.n_eff)) to rebuild them."""
        return {"n_prompts": self.n_prompts, "mode": self.mode, "rng_state": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        if state["n_prompts"] != self.n_prompts or state["mode"] != self.mode:
            raise ValueError(f"sampler.load_state_dict: checkpoint is for {state['n_prompts']} prompts, mode "
                             f"{state['mode']!r}; this run has {self.n_prompts}, {self.mode!r}")
        self.rng.bit_generator.state = state["rng_state"]
