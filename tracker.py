"""The SPO value tracker: one persistent baseline v(x) per prompt, instead of a group of G samples.

Paper (Xu & Ding, "Single-stream Policy Optimization", ICLR 2026), section 4.1 and Algorithm 2:
- Eq. 5: per prompt a Beta(alpha, beta); on a reward r, alpha <- rho*alpha + r, beta <- rho*beta + (1 - r),
  value v = alpha / (alpha + beta).
- rho(x) = 2^(-D(x)/D_half), clipped to [rho_min, rho_max]: forget faster when the policy has moved more.
- Eq. 6: offline initialisation, N0 = 1/(1 - rho_min), alpha0 = N0*v0, beta0 = N0*(1 - v0).
- Eq. 7: the same update written as an adaptive EMA, v <- v + eta*(r - v), eta = 1/(rho*N_eff + 1).
- Eq. 8: the advantage A = r - v_{-1}(x) uses the value from BEFORE this reward is absorbed.

Usage (in spo.py, per step, after drawing the batch `index` and scoring the responses):
    baseline = tracker.value_at(index)                 # (B,) read BEFORE update (Eq. 8)
    advantage = reward - baseline                      # (B,)
    tracker.update(index, reward, tracker.rho(divergence))
State is two float64 arrays indexed by a dense prompt index 0..n-1 (and a visit count per prompt, which only
the tracker probe's regime measurement reads); spo.py maps stable prompt keys (machinery/data.py) to it.
"""
import warnings

import numpy as np


class ValueTracker:
    """Per-prompt Beta(alpha, beta) counts. alpha and beta are the one source of truth; value and n_eff
    are derived from them.

    Binary and non-binary rewards share `update`. Write alpha = v*N, beta = (1-v)*N with N = alpha + beta.
    Eq. 5 then gives N' = rho*N + 1 and v' = (rho*N*v + r) / (rho*N + 1) = v + (r - v) / (rho*N + 1),
    which is Eq. 7 exactly, for ANY real r. So Eq. 7 for general rewards is the same arithmetic: for r in
    [0, 1] alpha and beta stay Beta pseudo-counts; for r outside [0, 1] one of them may go negative, but
    value and n_eff are still the EMA of Eq. 7. (The paper's text writes N_eff = alpha + beta + 1 next to
    Eq. 7; the derivation above shows eta = 1/(rho*(alpha + beta) + 1), i.e. N_eff = alpha + beta.)
    """

    def __init__(self, n_prompts, rho_min=0.875, rho_max=0.96, d_half=0.06, rho_constant=None):
        # (the ranges: spo.py's flags, errors.check_ranges: 0 < rho_min <= rho_max < 1, d_half > 0)
        self.n_prompts = int(n_prompts)
        self.rho_min, self.rho_max, self.d_half = float(rho_min), float(rho_max), float(d_half)
        self.rho_constant = None if rho_constant is None else float(rho_constant)
        # Uninformed prior Beta(0.5, 0.5): v = 0.5, N_eff = 1 (the paper's "no offline init" ablation).
        self.alpha = np.full(self.n_prompts, 0.5)
        self.beta = np.full(self.n_prompts, 0.5)
        self.visits = np.zeros(self.n_prompts, np.int64)  # rewards absorbed per prompt (not used by the algorithm)

    # ---- reading -------------------------------------------------------------------------------------
    @property
    def value(self):  # (n,) posterior mean v(x); allocates n floats, use value_at for a batch
        return self.alpha / (self.alpha + self.beta)

    @property
    def n_eff(self):  # (n,) effective sample size N_eff(x) = alpha + beta
        return self.alpha + self.beta

    def value_at(self, index):  # (B,) v for a batch of prompt indices, O(B)
        index = self._check_index(index)
        a, b = self.alpha[index], self.beta[index]
        return a / (a + b)

    def n_eff_at(self, index):  # (B,)
        index = self._check_index(index)
        return self.alpha[index] + self.beta[index]

    # ---- Algorithm 2 / Eq. 6: offline initialisation ----------------------------------------------
    def init_from_scores(self, index, successes, counts, smoothing="kt"):
        """Set alpha0 = N0*v0, beta0 = N0*(1 - v0) with N0 = 1/(1 - rho_min) for the prompts in `index`.

        successes: (K,) sum of the offline scores per prompt (scores may be fractional, in [0, 1]);
        counts: (K,) the number of offline samples each prompt REALLY got.
        smoothing "kt" (default): v0 = (s + 0.5)/(n + 1), Krichevsky-Trofimov, as the authors do but with
        the real n (their code used the configured n, so missing samples counted as failures). KT is the
        default because the plain mean gives v0 = 0 or 1 for prompts never / always solved, and those get
        sampling weight sqrt(v(1-v)) + eps = eps only, i.e. are almost never revisited (Eq. 11).
        smoothing "mean": v0 = s/n, the paper's plain mean.
        Prompts with n = 0 carry no information: they stay at the uninformed prior (with either
        smoothing; a warning says how many). Prompts not in `index` also keep the prior.
        """
        index = self._check_index(index)
        successes = np.asarray(successes, dtype=np.float64)
        counts = np.asarray(counts, dtype=np.float64)
        # (distinct prompts, 0 <= successes <= counts: offline_values.py:init_tracker_from_file reads them so)
        seen = counts > 0
        if not seen.all():
            warnings.warn(f"tracker.init_from_scores: {int((~seen).sum())} prompts have 0 offline samples; "
                          f"they keep the uninformed prior Beta(0.5, 0.5)", stacklevel=2)
        s, n, index = successes[seen], counts[seen], index[seen]
        v0 = (s + 0.5) / (n + 1.0) if smoothing == "kt" else s / n
        n0 = 1.0 / (1.0 - self.rho_min)  # the equilibrium N_eff under rho = rho_min: no transient at start
        self.alpha[index] = n0 * v0
        self.beta[index] = n0 - self.alpha[index]  # alpha0 + beta0 = N0 exactly

    # ---- the forgetting factor ----------------------------------------------------------------------
    def rho(self, divergence):
        """(B,) rho = 2^(-D/D_half) clipped to [rho_min, rho_max]; D = 0 (first visit) gives rho_max.
        With rho_constant set, that constant everywhere (the authors' `constant` option)."""
        divergence = np.asarray(divergence, dtype=np.float64)
        if not np.isfinite(divergence).all():
            raise ValueError("tracker.rho: divergence has NaN or inf entries")
        if self.rho_constant is not None:
            return np.full(divergence.shape, self.rho_constant)
        return np.clip(np.exp2(-divergence / self.d_half), self.rho_min, self.rho_max)

    # ---- Eq. 5 / Eq. 7: absorb rewards ----------------------------------------------------------------
    def update(self, index, reward, rho):
        """Absorb one reward per entry: alpha <- rho*alpha + r, beta <- rho*beta + (1 - r) (Eq. 5).

        index: (B,) prompt indices, repeats allowed (batch SPO, Appendix B: a prompt drawn G times in one
        batch). A repeated prompt is decayed ONCE and then gets all its rewards, so G samples of one batch
        count as G observations of the same policy. reward: (B,) finite floats; in [0, 1] this is the Beta
        update, outside it the Eq. 7 EMA (see the class docstring). rho: scalar or (B,); entries of a
        repeated prompt must share one rho.
        Call value_at(index) BEFORE this for the advantage A = r - v_{-1} (Eq. 8).
        """
        index = self._check_index(index)
        reward = np.asarray(reward, dtype=np.float64)
        rho = np.asarray(rho, dtype=np.float64)
        if rho.ndim == 0:
            rho = np.full(index.shape, rho)
        if reward.shape != index.shape or rho.shape != index.shape:
            raise ValueError(f"tracker.update: index, reward, rho must have the same length, "
                             f"got {index.shape}, {reward.shape}, {rho.shape}")
        if not np.isfinite(reward).all():
            raise ValueError("tracker.update: reward has NaN or inf entries")
        if not ((rho >= 0.0) & (rho <= 1.0)).all():
            raise ValueError("tracker.update: rho must lie in [0, 1]")

        prompts, first, slot = np.unique(index, return_index=True, return_inverse=True)  # (U,), (U,), (B,)
        rho_per_prompt = rho[first]  # (U,)
        if not np.array_equal(rho, rho_per_prompt[slot]):
            raise ValueError("tracker.update: a prompt repeated in one batch got different rho values")
        reward_sum = np.bincount(slot, weights=reward, minlength=len(prompts))  # (U,)
        n_obs = np.bincount(slot, minlength=len(prompts))  # (U,)
        self.alpha[prompts] = rho_per_prompt * self.alpha[prompts] + reward_sum
        self.beta[prompts] = rho_per_prompt * self.beta[prompts] + (n_obs - reward_sum)
        self.visits[prompts] += n_obs

    # ---- checkpointing --------------------------------------------------------------------------------
    def state_dict(self):
        return {"alpha": self.alpha.copy(), "beta": self.beta.copy(), "visits": self.visits.copy(),
                "rho_min": self.rho_min,
                "rho_max": self.rho_max, "d_half": self.d_half, "rho_constant": self.rho_constant}

    def load_state_dict(self, state):
        alpha = np.asarray(state["alpha"], dtype=np.float64)
        beta = np.asarray(state["beta"], dtype=np.float64)
        if alpha.shape != (self.n_prompts,) or beta.shape != (self.n_prompts,):
            raise ValueError(f"tracker.load_state_dict: checkpoint holds {alpha.shape[0] if alpha.ndim else '?'} "
                             f"prompts, this run has {self.n_prompts} (did the dataset change?)")
        self.alpha, self.beta = alpha.copy(), beta.copy()
        # (checkpoints made before the count existed resume with zeros: only the regime measurement reads it)
        self.visits = np.asarray(state.get("visits", np.zeros(self.n_prompts)), np.int64).copy()
        self.rho_min, self.rho_max, self.d_half = state["rho_min"], state["rho_max"], state["d_half"]
        self.rho_constant = state["rho_constant"]

    # ---- input checks ---------------------------------------------------------------------------------
    def _check_index(self, index):
        index = np.asarray(index)
        if index.ndim != 1 or not (np.issubdtype(index.dtype, np.integer) or index.size == 0):
            raise ValueError(f"tracker: index must be a 1-D integer array, got dtype {index.dtype}, "
                             f"shape {index.shape}")
        index = index.astype(np.int64, copy=False)
        if index.size and (index.min() < 0 or index.max() >= self.n_prompts):
            raise ValueError(f"tracker: prompt index out of range [0, {self.n_prompts}): "
                             f"min {index.min()}, max {index.max()}")
        return index
