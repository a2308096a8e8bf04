"""Property-based tests of bad input (hypothesis): whatever options,
batch sizes, shapes, dtypes and argument structures a program passes, a
call either runs or raises a clear error (``poptorch.Error`` or PyTorch's
own exception); a refused call changes neither the weights nor the
optimizer state, and the model trains on afterwards."""
import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poptorch
from conftest import ClassifierMLP, options

MICRO_BATCH = 2
CLEAR_ERRORS = (poptorch.Error, TypeError, ValueError, RuntimeError,
                IndexError)

layouts = st.fixed_dictionaries({
    "device_iterations": st.integers(1, 3),
    "accumulation": st.integers(1, 2),
    "replicas": st.integers(1, 2),
    "outputMode": st.sampled_from(
        [mode for mode in poptorch.OutputMode
         if mode != poptorch.OutputMode.EveryN] +
        [(poptorch.OutputMode.EveryN, 1)]),
    "floating_point_exceptions": st.booleans(),
})

bad_calls = st.fixed_dictionaries({
    "rows_factor": st.sampled_from([0, 0.5, 1, 1, 2, 3]),
    "features": st.sampled_from([4, 4, 5]),
    "x_dtype": st.sampled_from([torch.float32, torch.float32, torch.float64,
                                torch.float16, torch.int64]),
    "y_dtype": st.sampled_from([torch.int64, torch.int64, torch.int32,
                                torch.float32]),
    "structure": st.sampled_from(["pair", "pair", "x only", "extra",
                                  "listed", "keywords", "wrong keyword"]),
    "label_high": st.sampled_from([3, 3, 4]),
})


def build(layout):
    torch.manual_seed(0)
    module = ClassifierMLP()
    optimizer = poptorch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    opts = options(layout["device_iterations"], layout["accumulation"],
                   layout["replicas"], outputMode=layout["outputMode"])
    opts.Precision.enableFloatingPointExceptions(
        layout["floating_point_exceptions"])
    opts.showCompilationProgressBar(False)
    return module, optimizer, poptorch.trainingModel(module, opts, optimizer)


def rows_per_call(layout) -> int:
    return (layout["device_iterations"] * layout["accumulation"] *
            layout["replicas"] * MICRO_BATCH)


def good_data(layout, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = rows_per_call(layout)
    return (torch.randn(rows, 4, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def arguments(call, layout):
    """The positional and keyword arguments of a possibly bad call."""
    rows = int(rows_per_call(layout) * call["rows_factor"])
    x = torch.randn(rows, call["features"]).to(call["x_dtype"])
    y = torch.randint(0, call["label_high"], (rows,)).to(call["y_dtype"])
    return {"pair": ((x, y), {}), "x only": ((x,), {}),
            "extra": ((x, y, y), {}), "listed": (([x], y), {}),
            "keywords": ((), {"x": x, "y": y}),
            "wrong keyword": ((x,), {"labels": y})}[call["structure"]]


def snapshot(model, module, optimizer):
    model.copyWeightsToHost()
    return (copy.deepcopy(module.state_dict()),
            copy.deepcopy(optimizer.state_dict()["poptorch"]["device_state"]))


def assert_same(before, after):
    for (name, value), other in zip(before[0].items(), after[0].values()):
        assert torch.equal(value, other), name
    assert _equal_tree(before[1], after[1])


def _equal_tree(a, b) -> bool:
    leaves_a, spec_a = torch.utils._pytree.tree_flatten(a)
    leaves_b, spec_b = torch.utils._pytree.tree_flatten(b)
    return spec_a == spec_b and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(leaves_a, leaves_b))


def runs_or_raises_clearly(layout, args, kwargs) -> None:
    """A trained model's call with these arguments runs or raises a clear
    error leaving the weights and optimizer state as they were; either way
    the model trains on."""
    module, optimizer, model = build(layout)
    model(*good_data(layout))
    before = snapshot(model, module, optimizer)
    try:
        model(*args, **kwargs)
    except CLEAR_ERRORS as error:
        assert str(error)
        assert_same(before, snapshot(model, module, optimizer))
        _, loss = model(*good_data(layout, seed=1))
        assert torch.isfinite(loss).all()


# Fixed, bounded sets of examples: the same ones on every run.
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, call=bad_calls)
def test_calls_of_any_structure_shape_and_dtype_run_or_raise_clearly(
        layout, call):
    runs_or_raises_clearly(layout, *arguments(call, layout))


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, data=st.data())
def test_calls_with_bad_values_inside_the_loop_run_or_roll_back(layout,
                                                                 data):
    """Labels out of range and non-finite inputs at any micro-batch: the
    error comes from inside the device loop, after steps have run."""
    x, y = good_data(layout, seed=2)
    rows = len(y)
    for row in data.draw(st.lists(st.integers(0, rows - 1), max_size=2)):
        y[row] = data.draw(st.sampled_from([3, 7, -5]))
    for row in data.draw(st.lists(st.integers(0, rows - 1), max_size=2)):
        x[row, data.draw(st.integers(0, 3))] = data.draw(
            st.sampled_from([float("nan"), float("inf")]))
    runs_or_raises_clearly(layout, (x, y), {})
