"""A plain NumPy reference of the GNMR rules, written independently of the library.

Works on a [steps, units] array of gradient norms, unit by unit, with Python
lists for the windows; float32 arithmetic like the library, so masks agree
exactly and scores to rounding.
"""
import collections

import numpy as np

f32 = np.float32
F32_EPS = float(np.finfo(np.float32).eps)


def _ratio(num, den):
  if den > 0:
    return f32(f32(num) / f32(den))
  return f32(np.inf) if num > 0 else f32(1.0)


def run_reference(norms, *, alpha, beta, delta, max_o, t_lock, warmup=0):
  """Returns a dict of [steps, units] arrays: mask, lock, gnmr, delta_gnmr, score, risky."""
  norms = np.asarray(norms, np.float32)
  steps, n_units = norms.shape
  hist_sum = [f32(0.0)] * n_units
  hist_cnt = [0] * n_units
  windows = [collections.deque(maxlen=delta) for _ in range(n_units)]
  lock = [0] * n_units
  out = collections.defaultdict(list)
  for t in range(1, steps + 1):
    a = f32(alpha(t - 1) if callable(alpha) else alpha)
    b = f32(beta(t - 1) if callable(beta) else beta)
    g_t, d_t, score, risky = [], [], [], []
    for u in range(n_units):
      n = norms[t - 1, u]
      if not np.isfinite(n):
        g, d, r, s = f32(np.inf), f32(np.inf), True, f32(np.inf)
      else:
        g = f32(1.0) if hist_cnt[u] == 0 else _ratio(n, f32(hist_sum[u] / f32(hist_cnt[u])))
        if windows[u]:
          total = f32(0.0)
          for v in windows[u]:
            total = f32(total + v)
          d = _ratio(g, f32(total / f32(len(windows[u]))))
        else:
          d = f32(1.0)
        r = bool(g > a or d > b)
        s = f32(max(f32(g / a), f32(d / b)))
      g_t.append(g); d_t.append(d); score.append(s); risky.append(r)
    candidates = [u for u in range(n_units) if risky[u] or lock[u] > 0]
    candidates.sort(key=lambda u: (-score[u], u))
    chosen = set(candidates[:max_o]) if t > warmup else set()
    for u in range(n_units):
      if u in chosen and risky[u]:
        lock[u] = t_lock
      elif not risky[u] and lock[u] > 0:
        lock[u] -= 1
      n = norms[t - 1, u]
      if np.isfinite(n):
        hist_sum[u] = f32(hist_sum[u] + n)
        hist_cnt[u] += 1
        if np.isfinite(g_t[u]):
          windows[u].append(g_t[u])
    out["mask"].append([u in chosen for u in range(n_units)])
    out["lock"].append(list(lock))
    out["gnmr"].append(g_t)
    out["delta_gnmr"].append(d_t)
    out["score"].append(score)
    out["risky"].append(risky)
  return {k: np.asarray(v) for k, v in out.items()}


def library_rtols(delta):
  """Relative bounds on the library's gnmr, delta_gnmr and score vs this reference.

  Both add the norms in step order, so the history sums agree; XLA may still round
  each division differently (a reciprocal, a fusion): <= eps per division. GNMR
  has two (mean, ratio). dGNMR adds the window: its <= delta GNMR values (2 eps
  each), summed in ring order instead of step order (2 gamma_delta ~ delta eps),
  then two divisions. The score adds one division, and a scheduled threshold may
  round differently too.
  """
  gnmr = 2 * F32_EPS
  delta_gnmr = gnmr + delta * F32_EPS + 2 * F32_EPS
  return {"gnmr": gnmr, "delta_gnmr": delta_gnmr, "score": delta_gnmr + 2 * F32_EPS}
