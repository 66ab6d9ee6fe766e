"""The priority table: every built-in entry builds from the config, and a registered priority
runs under the budgeted rules (checked against a NumPy reference), with its own checked field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gnmr_jax
from gnmr_jax import control
from gnmr_jax.config import base_config, validate_config

BUILT_IN = ("gnmr", "norm", "gap", "relgap", "oracle", "hybrid", "random", "noise", "fixed",
            "last_blocks", "late_switch", "saturation")


def _smallest_first(signals, options):
  """A priority of a user's: the units with the smallest gradient norm, scaled by a field."""
  return control.Ranking(value=-options["weight"] * signals.norm)


def _check_weight(where, value, options):
  del options
  if not isinstance(value, float) or value <= 0:
    raise ValueError(f"{where} must be a float > 0, got {value!r}.")


SMALLEST = control.Ranked("smallest", "the units with the smallest gradient norm",
                          rank=_smallest_first, t_lock=1,
                          fields=(control.Field("weight", 1.0, _check_weight, "a scale"),))


@pytest.fixture
def registered():
  control.register_priority(SMALLEST)
  yield SMALLEST
  control.unregister_priority("smallest")


def test_the_table_holds_the_built_in_priorities_with_a_doc_line_each():
  assert control.priority_names()[:len(BUILT_IN)] == BUILT_IN
  for name in BUILT_IN:
    entry = control.get_priority(name)
    assert entry.name == name and entry.doc
  assert [n for n in BUILT_IN if control.needs_recovery_gap(n)] == ["gap", "relgap", "oracle",
                                                                     "noise"]
  with pytest.raises(ValueError, match="config.gnmr.priority must be one of"):
    control.get_priority("nope")


def _reference_masks(norms, max_o, t_lock, warmup, largest=False):
  """The budgeted rules in NumPy (float64): locked units first, then the smallest norms (the
  largest: 'norm'); the mask made at step t is used at t + 1; a unit that enters gets t_lock
  steps of lock."""
  n = norms.shape[1]
  mask, lock, masks = np.zeros(n, bool), np.zeros(n, int), []
  for t, norm in enumerate(norms, start=1):
    order = np.lexsort((-norm if largest else norm, -(lock > 0).astype(int)))  # primary: locked first; then the smallest norm
    selected = np.zeros(n, bool)
    if t > warmup:
      selected[order[:max_o]] = True
    lock = np.where(selected & ~mask, t_lock, np.maximum(lock - 1, 0))
    mask = selected
    masks.append(mask.copy())
  return np.array(masks)


def test_a_registered_priority_runs_from_the_config_under_the_budget_and_lock(registered):
  config = base_config("tiny")
  config.gnmr.update(priority="smallest", max_o=2, warmup=1)
  config.gnmr.t_lock = None  # the entry's default lock, 1
  config.gnmr.weight = 2.0
  validate_config(config, 1)
  config.gnmr.update(units="", layer_axis="^u$")  # one layer-stacked leaf of 5 units
  tx = control.from_config(config.gnmr)
  norms = np.random.default_rng(0).uniform(0.5, 2.0, size=(12, 5)).astype(np.float32)
  params = {"u": jnp.zeros((5, 3, 3))}
  update = jax.jit(lambda g, s: tx.update(g, s, params)[1])
  state, masks = tx.init(params), []
  for norm in norms:  # each unit's gradient: norm / 3 in each of its 9 entries
    state = update({"u": jnp.broadcast_to(jnp.asarray(norm / 3)[:, None, None], (5, 3, 3))},
                   state)
    masks.append(np.asarray(gnmr_jax.recovery_mask(state)["u"]))
  np.testing.assert_array_equal(np.array(masks), _reference_masks(norms, 2, 1, 1))


def test_a_registered_field_is_checked_and_refused_for_another_priority(registered):
  config = base_config("tiny")
  config.gnmr.priority = "smallest"
  config.gnmr.weight = -1.0
  with pytest.raises(ValueError, match=r"config.gnmr.weight must be a float > 0, got -1.0"):
    validate_config(config, 1)
  config.gnmr.priority = "norm"
  with pytest.raises(ValueError, match="config.gnmr.weight=-1.0 is read by priority 'smallest'"):
    validate_config(config, 1)
  with pytest.raises(ValueError, match="priority 'smallest' has no field 'wieght'"):
    SMALLEST.options({"wieght": 1.0}, "config.gnmr.")


@pytest.mark.parametrize("entry, message", [
    (SMALLEST, "already in the table"),
    (control.Ranked("mine", "", rank=None), "`rank` must be callable"),
    (control.Ranked("my priority", "", rank=_smallest_first), "must be an identifier"),
    (control.Ranked("mine", "", rank=_smallest_first, fields=(control.Field("max_o", 1),)),
     "'max_o' is a shared config.gnmr field"),
    (control.Ranked("mine", "", rank=_smallest_first, fields=(control.Field("noise_upper", 1),)),
     "field 'noise_upper' is priority 'noise''s"),
    ("norm", "takes a Ranked, StaticSet or Built entry"),
    (control.Ranked("norm", "", rank=_smallest_first), "'norm' is built in"),
    (control.Ranked("mine", "", rank=_smallest_first,
                    fields=(control.Field("a", 1), control.Field("a", 2))),
     "distinct identifier names")])
def test_register_refuses_what_the_table_cannot_hold(registered, entry, message):
  with pytest.raises(ValueError, match=message):
    control.register_priority(entry)
  assert control.priority_names()[-1] == "smallest"


def test_built_in_entries_cannot_be_unregistered():
  with pytest.raises(ValueError, match="'norm' is not a registered priority"):
    control.unregister_priority("norm")


def test_replay_runs_the_configured_controller_over_batches_of_sequences():
  from gnmr_jax import replay  # pylint: disable=import-outside-toplevel
  norms = np.random.default_rng(1).uniform(0.5, 2.0, size=(2, 15, 6)).astype(np.float32)
  g = dict(priority="norm", max_o=2, t_lock=3, warmup=2, alpha=2.0, beta=1.5, delta=4)
  out = replay.replay(g, norms, fields=("mask", "value"))
  for b in range(2):
    np.testing.assert_array_equal(out["mask"][b], _reference_masks(norms[b], 2, 3, 2, True))
    np.testing.assert_array_equal(out["value"][b], norms[b])  # the ranking's value: the norm
  with pytest.raises(ValueError, match="'value' is a budgeted priority's field"):
    replay.replay({**g, "priority": "gnmr"}, norms, fields=("value",))


def _over_one_and_a_half(signals, options):
  """A ranking whose candidates are the units with a norm over 1.5, all at tier 0."""
  del options
  return control.Ranking(value=signals.norm, tier=jnp.zeros_like(signals.lock),
                         candidate=signals.norm > 1.5)


def test_a_ranking_cannot_drop_or_outrank_a_locked_unit():
  """A unit that enters the mask keeps it for t_lock more steps, whatever candidates and tiers
  the ranking returns: unit 1 enters at step 1 (lock 2) and holds the budget of 1 through
  step 3 against unit 2's larger norm; unit 2 takes it at step 4."""
  from gnmr_jax import replay  # pylint: disable=import-outside-toplevel
  entry = control.register_priority(control.Ranked("over_threshold", "",
                                                   rank=_over_one_and_a_half), replace=True)
  try:
    g = dict(priority="over_threshold", max_o=1, t_lock=2, warmup=0, alpha=2.0, beta=1.5,
             delta=4)
    norms = np.array([[1, 2, 1], [1, 1, 3], [1, 1, 3], [1, 1, 3]], np.float32)
    masks = replay.replay(g, norms, fields=("mask",))["mask"]
    np.testing.assert_array_equal(masks, [[False, True, False], [False, True, False],
                                          [False, True, False], [False, False, True]])
  finally:
    control.unregister_priority(entry.name)
