"""rudax.run's halting checks: a non-finite loss or parameter stops the run, naming the update,
the first bad parameter's pytree path and the checkpoint that stays the latest."""

import jax.numpy as jnp
import pytest
from flax import nnx

from rudax.run import TrainingHalted, check_finite, check_loss


def test_finite_values_pass_and_latest_is_not_read():
    def latest():
        raise AssertionError("read only when there is something to report")

    check_loss(1.5, step=3, latest=latest)
    check_finite({"w": jnp.ones((2, 2)), "b": jnp.zeros(2, jnp.bfloat16)}, step=3, latest=latest)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_loss_halts_naming_the_update_and_the_kept_checkpoint(loss):
    with pytest.raises(TrainingHalted, match=rf"update 9: the training loss is {loss}; .*"
                       r"checkpoint 8 is the latest and is kept"):  # fmt: skip
        check_loss(loss, step=9, latest=lambda: 8)
    with pytest.raises(TrainingHalted, match="no checkpoint was written yet"):
        check_loss(loss, step=1, latest=lambda: None)


def test_a_non_finite_parameter_is_named_by_its_path_with_the_count_of_others():
    params = {
        "a": jnp.ones(3),
        "b": jnp.array([1.0, jnp.nan], jnp.bfloat16),
        "c": {"d": jnp.array([jnp.inf])},
    }
    with pytest.raises(
        TrainingHalted,
        match=r"update 5: parameter params\['b'\] is not finite \(inf or NaN\), and 1 more; "
        r"not saving checkpoint 5, checkpoint 4 is the latest",
    ):
        check_finite(params, step=5, latest=lambda: 4)


def test_an_nnx_state_is_named_by_the_parameter_path_users_know():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    model.bias.value = model.bias.value.at[1].set(jnp.nan)
    with pytest.raises(TrainingHalted, match=r"parameter params\['bias'\] is not finite"):
        check_finite(nnx.state(model), step=2, latest=lambda: None)
