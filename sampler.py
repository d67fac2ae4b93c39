"""
Prioritized prompt sampling for SPO: draw B distinct prompts, favouring those whose outcome is uncertain.

Paper (Xu & Ding, ICLR 2026), Eq. 11 with the ICLR version's N_eff^gamma term:
    w(x) = sqrt(v(x) (1 - v(x))) / N_eff(x)^gamma + eps,     eps = 0.05, gamma in [0, 1] (0 = arXiv form)
The first term is the Bernoulli standard deviation (prompts neither always solved nor never solved);
eps keeps every prompt reachable (no curriculum collapse); N_eff^gamma favours prompts the tracker knows less.
A batch is B prompts drawn WITHOUT replacement with probability proportional to w ("successive sampling",
the distribution of numpy's choice(replace=False, p=w/sum(w))), once per step (Algorithm 1).

Usage (in spo.py):
    sampler = PromptSampler(n_prompts, seed)
    sampler.set_weights(priority_weights(tracker.value, tracker.n_eff))                    # once, all prompts
    each step:  index = sampler.draw(B)  ...  tracker.update(index, reward, rho)
                sampler.set_weights(priority_weights(tracker.value_at(index), tracker.n_eff_at(index)), index)
Only the B prompts whose tracker state changed get new weights, so a step costs O(B log n), not O(n).
"""
import numpy as np


def priority_weights(value, n_eff, eps=0.05, gamma=0.0):
    """Eq. 11: sqrt(v(1-v)) / n_eff**gamma + eps, vectorised. v is clipped into [0, 1] first: the Eq. 7
    EMA of rewards outside [0, 1] can leave it, and sqrt of a negative number would be NaN."""
    if eps < 0 or gamma < 0:
        raise ValueError(f"sampler.priority_weights: need eps >= 0 and gamma >= 0, got {eps}, {gamma}")
    v = np.clip(np.asarray(value, dtype=np.float64), 0.0, 1.0)
    spread = np.sqrt(v * (1.0 - v))
    if gamma != 0:
        spread = spread / np.asarray(n_eff, dtype=np.float64) ** gamma
    return spread + eps


class PromptSampler:
    """Seeded weighted sampling of B distinct prompt indices, without replacement.

    Two exact methods for successive sampling; `method="auto"` picks by the ratio n/B:
    - "tree": successive sampling is the same as drawing WITH replacement and keeping the first occurrence
      of each prompt until B distinct prompts are seen (given the prompts seen so far, the next new one is
      drawn proportional to w among the unseen: that is the definition). Draws with replacement come from
      a sum tree (levels of pairwise sums, every draw descending all levels at once, vectorised), and a
      weight change repairs only its ancestors. Cost per step O(B log n) (`python -m bench tracker` measures it against
      Gumbel-top-k's O(n)).
    - "gumbel": Gumbel-top-k: argpartition of log w + Gumbel noise, ordered by key (Plackett-Luce = the
      same successive-sampling distribution, order included). O(n) per draw, but it needs no repeats, so
      it is the better choice when B is a large fraction of n (e.g. DAPO: 1024 of 14k prompts).
    If the tree path sees too many repeats (weight concentrated on few prompts) it stops and draws the rest
    with Gumbel-top-k over the unseen prompts: exact, because that is the conditional distribution.

    The tree is rebuilt from children at every change (never updated by adding deltas), so incremental
    set_weights(w_B, index) and a full set_weights(w) give bit-identical trees: a resumed run that rebuilds
    the weights from the tracker draws exactly the same prompts as an uninterrupted one.
    """

    TREE_MIN_RATIO = 16  # auto: tree when n >= 16 * B (the methods' costs cross near n = 8 B: python -m bench tracker)
    TREE_ROUNDS = 4  # with-replacement rounds before finishing with Gumbel-top-k

    def __init__(self, n_prompts, seed, mode="prioritized", method="auto"):
        if int(n_prompts) != n_prompts or n_prompts < 1:
            raise ValueError(f"sampler: n_prompts must be a positive integer, got {n_prompts!r}")
        if mode not in ("prioritized", "uniform"):
            raise ValueError(f"sampler: mode must be 'prioritized' or 'uniform', got {mode!r}")
        if method not in ("auto", "tree", "gumbel"):
            raise ValueError(f"sampler: method must be 'auto', 'tree' or 'gumbel', got {method!r}")
        self.n_prompts, self.mode, self.method = int(n_prompts), mode, method
        self.rng = np.random.default_rng(seed)
        self.levels = None  # sum tree: levels[0] = leaf weights, levels[-1] = [total]
        if mode == "prioritized":
            self.set_weights(np.ones(self.n_prompts))  # uniform until the caller sets tracker weights

    # ---- weights ---------------------------------------------------------------------------------------
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
            self.levels = [_pad_even(weights.copy())]
            while len(self.levels[-1]) > 1:
                below = self.levels[-1]
                self.levels.append(_pad_even(below[0::2] + below[1::2]))
            return
        index = np.asarray(index)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer) or weights.shape != index.shape:
            raise ValueError(f"sampler.set_weights: index must be 1-D integers matching weights, got "
                             f"{index.dtype} {index.shape} and weights {weights.shape}")
        if index.size and (index.min() < 0 or index.max() >= self.n_prompts):
            raise ValueError(f"sampler.set_weights: index out of range [0, {self.n_prompts})")
        if len(np.unique(index)) != len(index):
            raise ValueError("sampler.set_weights: index has repeated prompts (which weight would win?)")
        self.levels[0][index] = weights
        node = index.astype(np.int64)
        for below, level in zip(self.levels[:-1], self.levels[1:]):
            node = node // 2  # repeated parents just recompute the same sum
            level[node] = below[2 * node] + below[2 * node + 1]

    @property
    def weights(self):  # (n,) current weights (a view), None in uniform mode
        return None if self.levels is None else self.levels[0][: self.n_prompts]

    # ---- drawing ---------------------------------------------------------------------------------------
    def draw(self, batch_size, weights=None):
        """(B,) int64 distinct prompt indices, in random order. `weights` (n,), if given, replaces all weights
        first."""
        if int(batch_size) != batch_size or not 1 <= batch_size <= self.n_prompts:
            raise ValueError(f"sampler.draw: batch_size must be in [1, {self.n_prompts}], got {batch_size}")
        batch_size = int(batch_size)
        if self.mode == "uniform":
            return self.rng.choice(self.n_prompts, size=batch_size, replace=False).astype(np.int64)
        if weights is not None:
            self.set_weights(weights)
        if not self.levels[-1][0] > 0:
            raise ValueError("sampler.draw: all prompt weights are 0")
        method = self.method
        if method == "auto":
            method = "tree" if self.n_prompts >= self.TREE_MIN_RATIO * batch_size else "gumbel"
        if method == "gumbel":
            drawn = self._gumbel_top_k(batch_size, exclude=np.empty(0, np.int64))
        else:
            drawn = self._tree_draw(batch_size)
        # In random order: the Gumbel draw comes out sorted by key, most uncertain prompts first, and callers
        # slice the batch across ranks and PPO mini-batches (rank 0 and the first mini-batch would get them all).
        return self.rng.permutation(drawn)

    def _tree_draw(self, batch_size):
        stream = np.empty(0, np.int64)  # prompts drawn with replacement, in draw order
        for _ in range(self.TREE_ROUNDS):
            missing = batch_size - len(np.unique(stream))
            if missing <= 0:
                break
            stream = np.concatenate([stream, self._with_replacement(missing + missing // 4 + 8)])
        _, first = np.unique(stream, return_index=True)
        distinct = stream[np.sort(first)]  # first occurrences, in the order they were drawn
        if len(distinct) >= batch_size:
            return distinct[:batch_size]
        return np.concatenate([distinct, self._gumbel_top_k(batch_size - len(distinct), exclude=distinct)])

    def _with_replacement(self, n_draws):
        """(<= n_draws,) i.i.d. draws proportional to w: descend the sum tree, all draws level by level."""
        mass = self.rng.random(n_draws) * self.levels[-1][0]  # (D,) uniform on [0, total)
        node = np.zeros(n_draws, dtype=np.int64)
        for level in reversed(self.levels[:-1]):
            left = 2 * node
            left_mass = level[left]
            go_right = mass >= left_mass
            mass = np.where(go_right, mass - left_mass, mass)
            node = left + go_right
        # Rounding can push a draw onto a zero-weight leaf (or the padding leaf): drop it.
        return node[self.levels[0][node] > 0]

    def _gumbel_top_k(self, k, exclude):
        """(k,) successive sampling of k prompts outside `exclude`: the k largest log w + Gumbel noise,
        in decreasing key order."""
        with np.errstate(divide="ignore"):
            keys = np.log(self.weights) + self.rng.gumbel(size=self.n_prompts)  # (n,), -inf where w = 0
        keys[exclude] = -np.inf
        top = np.argpartition(keys, self.n_prompts - k)[self.n_prompts - k:] if k < self.n_prompts \
            else np.arange(self.n_prompts)
        top = top[np.argsort(-keys[top], kind="stable")]
        if not np.isfinite(keys[top]).all():
            raise ValueError(f"sampler.draw: fewer prompts with weight > 0 than the batch size "
                             f"({int(np.isfinite(keys).sum()) + len(exclude)} < {k + len(exclude)})")
        return top.astype(np.int64)

    # ---- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self):
        """The RNG state only. Weights are a function of the tracker: after load_state_dict, call
        set_weights(priority_weights(tracker.value, tracker.n_eff)) to rebuild them."""
        return {"n_prompts": self.n_prompts, "mode": self.mode, "method": self.method,
                "rng_state": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        if state["n_prompts"] != self.n_prompts or state["mode"] != self.mode:
            raise ValueError(f"sampler.load_state_dict: checkpoint is for {state['n_prompts']} prompts, mode "
                             f"{state['mode']!r}; this run has {self.n_prompts}, {self.mode!r}")
        self.method = state["method"]
        self.rng.bit_generator.state = state["rng_state"]


def _pad_even(level):
    """Append a zero-weight slot to odd-length levels (except the root) so node i has children 2i, 2i+1."""
    return np.append(level, 0.0) if len(level) > 1 and len(level) % 2 else level
