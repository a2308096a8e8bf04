"""CTC loss with static shapes (``_impl/ctc_loss.py``): losses and
gradients for ``log_probs`` equal to PyTorch's ``F.ctc_loss`` (atol 1e-5
in float32) eagerly, under vmap, and in captured training and inference
models, reached through ``F.ctc_loss`` / ``nn.CTCLoss`` and through
``poptorch.custom_op(..., "Ctc", "ai.graphcore", ...)``. Every test runs
both paths: PyTorch's kernels in one op (``ctc_loss_kernels.py``, the
CPU's) and the frame-by-frame recursion (other devices')."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import poptorch
from conftest import assert_same_weights, options, reference_training
from poptorch._impl import ctc_loss as ctc_loss_module
from poptorch._impl.ctc_loss import ctc_loss

ATOL = 1e-5
FRAMES, BATCH, CLASSES, WIDTH = 8, 5, 5, 4


@pytest.fixture(autouse=True, params=["pytorch-kernels", "recursion"])
def path(request, monkeypatch):
    """Which op ``ctc_loss`` runs on the CPU."""
    if request.param == "recursion":
        monkeypatch.setattr(ctc_loss_module, "uses_pytorch_kernels",
                            lambda log_probs: False)
    return request.param


def _log_probs(frames=FRAMES, batch=BATCH, classes=CLASSES, seed=0,
               dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(frames, batch, classes, generator=generator,
                       dtype=dtype).log_softmax(-1)


def _hard_batch():
    """Padded targets: a repeated label (needs a blank between), an
    alignment that is impossible (4 labels with a repeat in 4 frames), an
    empty target, an empty input with an empty target, and a target that
    fills its input."""
    targets = torch.tensor([[1, 1, 2, 3], [2, 2, 3, 4], [3, 0, 0, 0],
                            [4, 4, 4, 4], [1, 2, 3, 4]])
    input_lengths = torch.tensor([8, 4, 6, 0, 4])
    target_lengths = torch.tensor([4, 4, 0, 0, 4])
    return targets, input_lengths, target_lengths


def _loss_and_gradient(function, log_probs, *args, **kwargs):
    """The loss and the gradient for ``log_probs`` of the loss scaled by
    fixed weights (so that per-sample gradients differ)."""
    log_probs = log_probs.detach().clone().requires_grad_()
    loss = function(log_probs, *args, **kwargs)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach(), log_probs.grad


def _assert_like_pytorch(log_probs, *args, atol=ATOL, **kwargs):
    expected = _loss_and_gradient(F.ctc_loss, log_probs, *args, **kwargs)
    actual = _loss_and_gradient(ctc_loss, log_probs, *args, **kwargs)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, atol=atol, rtol=0,
                                   equal_nan=True)
    return expected


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_padded_targets_like_pytorch(reduction, zero_infinity):
    loss, gradient = _assert_like_pytorch(
        _log_probs(), *_hard_batch(), reduction=reduction,
        zero_infinity=zero_infinity)
    assert torch.isfinite(loss).all() == zero_infinity
    assert torch.isnan(gradient).any() != zero_infinity


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_pytorch_kernels_give_pytorchs_results_bit_for_bit(path,
                                                           zero_infinity):
    """(The recursion rounds differently: atol 1e-5 there.)"""
    _assert_like_pytorch(_log_probs(), *_hard_batch(), reduction="none",
                         zero_infinity=zero_infinity,
                         atol=0 if path == "pytorch-kernels" else ATOL)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_concatenated_targets_and_lengths_as_sequences(dtype):
    targets, input_lengths, target_lengths = _hard_batch()
    concatenated = torch.cat([row[:length] for row, length in
                              zip(targets, target_lengths)]).to(dtype)
    _assert_like_pytorch(_log_probs(), concatenated, input_lengths.tolist(),
                         tuple(target_lengths.tolist()), reduction="none")
    _assert_like_pytorch(_log_probs(), concatenated, input_lengths.to(dtype),
                         target_lengths.to(dtype), reduction="mean")


def test_targets_longer_than_the_input():
    """Width bounded by T = 3 frames: the 4-label target has no alignment,
    padded or concatenated."""
    log_probs = _log_probs(frames=3, batch=2)
    targets = torch.tensor([[1, 2, 3, 4], [2, 3, 0, 0]])
    input_lengths, target_lengths = torch.tensor([3, 3]), torch.tensor([4, 2])
    loss, _ = _assert_like_pytorch(log_probs, targets, input_lengths,
                                   target_lengths, reduction="none",
                                   zero_infinity=True)
    assert loss[0] == 0 and loss[1] > 0
    _assert_like_pytorch(log_probs, torch.tensor([1, 2, 3, 4, 2, 3]),
                         input_lengths, target_lengths, reduction="none")


def test_blank_not_zero_in_float64():
    targets = torch.tensor([[0, 1, 1, 4], [4, 0, 3, 3], [1, 1, 1, 1],
                            [1, 0, 1, 0], [3, 4, 0, 1]])
    _assert_like_pytorch(_log_probs(dtype=torch.float64), targets,
                         [8, 8, 7, 6, 8], [4, 3, 2, 4, 1], blank=2,
                         atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_log_probs_are_computed_in_float32(dtype):
    """200 frames of float16 (bfloat16) log probabilities: the loss and its
    gradient are PyTorch's float32 ones of the same values, within a
    rounding unit of the input's dtype (the recursion in float16 lost the
    gradient: 126 % off)."""
    torch.manual_seed(0)
    log_probs = torch.randn(200, 2, 30).log_softmax(-1).to(dtype)
    log_probs.requires_grad_()
    targets = torch.randint(1, 30, (2, 40))
    lengths = (torch.tensor([200, 198]), torch.tensor([40, 39]))
    loss = ctc_loss(log_probs, targets, *lengths)
    loss.backward()
    wide = log_probs.detach().float().requires_grad_()
    expected = F.ctc_loss(wide, targets, *lengths)
    expected.backward()
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, expected.to(dtype))
    unit = torch.finfo(dtype).eps * wide.grad.abs().max().item()
    torch.testing.assert_close(log_probs.grad, wide.grad.to(dtype),
                               atol=unit, rtol=0)


def test_unbatched_input():
    _assert_like_pytorch(_log_probs()[:, 0], torch.tensor([1, 1, 3]),
                         torch.tensor(7), torch.tensor(3), reduction="none")


def test_replicas_under_vmap_are_one_batch():
    """The vmap rule (vectorised replicas) gives each replica its own
    losses and gradients."""
    log_probs = torch.stack([_log_probs(seed=s) for s in range(3)])
    targets, input_lengths, target_lengths = _hard_batch()
    stacked = [t.expand(3, *t.shape) for t in _hard_batch()]

    def loss(lp, tg, il, tl):
        return ctc_loss(lp, tg, il, tl, reduction="mean", zero_infinity=True)

    batched = log_probs.clone().requires_grad_()
    losses = torch.func.vmap(loss)(batched, *stacked)
    losses.sum().backward()
    for replica in range(3):
        alone = log_probs[replica].clone().requires_grad_()
        want = F.ctc_loss(alone, targets, input_lengths, target_lengths,
                          reduction="mean", zero_infinity=True)
        want.backward()
        torch.testing.assert_close(losses[replica].detach(), want.detach(),
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(batched.grad[replica], alone.grad,
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("arguments, message", [
    ({"reduction": "average"}, "reduction must be one of"),
    ({"blank": CLASSES}, "blank must be a class index in"),
    ({"input_lengths": [8.0] * BATCH}, "input_lengths must hold integers"),
    ({"targets": torch.zeros(BATCH, 4)}, "targets must be an integer"),
])
def test_bad_arguments(arguments, message):
    targets, input_lengths, target_lengths = _hard_batch()
    call = {"targets": targets, "input_lengths": input_lengths,
            "target_lengths": target_lengths, **arguments}
    with pytest.raises(poptorch.Error, match=message):
        ctc_loss(_log_probs(), **call)


class FrameClassifier(torch.nn.Module):
    """Frames [N, T, 3] -> log probabilities [T, N, C] and nn.CTCLoss."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.fc = torch.nn.Linear(3, CLASSES)
        self.loss = torch.nn.CTCLoss(reduction=reduction, zero_infinity=True)

    def forward(self, frames, targets, input_lengths, target_lengths):
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)
        return log_probs, self.loss(log_probs, targets, input_lengths,
                                    target_lengths)


def _frames_and_targets(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    frames = torch.randn(rows, FRAMES, 3, generator=generator)
    targets = torch.randint(1, CLASSES, (rows, WIDTH), generator=generator)
    input_lengths = torch.randint(5, FRAMES + 1, (rows,),
                                  generator=generator).int()
    target_lengths = torch.randint(0, WIDTH, (rows,),
                                   generator=generator).int()
    return frames, targets, input_lengths, target_lengths


def test_training_model_with_iterations_accumulation_and_replicas():
    """D = 2, G = 2, R = 2 (vectorised replicas), two calls: the
    micro-batch losses and the trained weights equal plain PyTorch's."""
    _train_like_plain_pytorch(options(2, 2, 2))


@pytest.mark.slow
def test_training_model_on_inductor():
    """As above, compiled by Inductor, which checks the strides of the
    kernels op's gradient (contiguous, also for the transposed log
    probabilities) against its fake implementation's: it declared
    log_probs' strides, and the first call failed."""
    _train_like_plain_pytorch(options(2, 2, 2, setBackend="inductor"))


def _train_like_plain_pytorch(opts):
    torch.manual_seed(0)
    model = FrameClassifier()
    twin = copy.deepcopy(model)
    data = _frames_and_targets(2 * 2 * 2 * 3)
    training = poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    for _ in range(2):
        _, losses = training(*data)
        expected = reference_training(twin, reference, data, 2, 2, 2)
        torch.testing.assert_close(losses.flatten(), expected[-2:].flatten(),
                                   atol=ATOL, rtol=0)
    assert_same_weights(model, twin, atol=ATOL)


class ConcatenatingModel(torch.nn.Module):
    """F.ctc_loss with concatenated targets, given as they are."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, CLASSES)

    def forward(self, frames, targets, input_lengths, target_lengths):
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                          reduction="sum")


def test_training_model_with_concatenated_targets():
    torch.manual_seed(0)
    model = ConcatenatingModel()
    twin = copy.deepcopy(model)
    frames, targets, input_lengths, target_lengths = _frames_and_targets(4)
    concatenated = torch.cat([row[:length] for row, length in
                              zip(targets, target_lengths)])
    data = (frames, concatenated, input_lengths, target_lengths)
    training = poptorch.trainingModel(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(3):
        loss = training(*data)
        reference.zero_grad()
        expected = twin(*data)
        expected.backward()
        reference.step()
        torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    assert_same_weights(model, twin, atol=ATOL)


def test_inference_model_per_sample_losses():
    torch.manual_seed(0)
    model = FrameClassifier(reduction="none")
    data = _frames_and_targets(2 * 4)
    inference = poptorch.inferenceModel(model, options(2))
    _, losses = inference(*data)
    _, expected = model(*data)
    torch.testing.assert_close(losses, expected.detach(), atol=ATOL, rtol=0)


class GraphcoreCtcModel(torch.nn.Module):
    """The CTC loss as PopTorch speech models called it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, CLASSES)

    def forward(self, frames, targets, input_lengths, target_lengths):
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)
        loss, = poptorch.custom_op(
            [log_probs, targets, input_lengths, target_lengths], "Ctc",
            "ai.graphcore", 1, example_outputs=[torch.zeros(())],
            attributes={"blank": 0, "reduction": 0, "zeroInfinity": 1})
        return loss


def test_graphcore_ctc_custom_op_trains_like_ctc_loss_sum():
    torch.manual_seed(0)
    model = GraphcoreCtcModel()
    twin = copy.deepcopy(model)
    data = _frames_and_targets(4)
    training = poptorch.trainingModel(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(2):
        loss = training(*data)
        reference.zero_grad()
        log_probs = twin.fc(data[0]).log_softmax(-1).transpose(0, 1)
        expected = F.ctc_loss(log_probs, *data[1:], reduction="sum",
                              zero_infinity=True)
        expected.backward()
        reference.step()
        torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    assert_same_weights(model, twin, atol=ATOL)


@pytest.mark.parametrize("attributes, message", [
    ({"reduction": 3}, "attribute reduction must be"),
    ({"zeroInfinity": 2}, "attribute zeroInfinity must be"),
    ({"outDataType": "INT8"}, "attribute outDataType must be"),
    ({"blanks": 1}, "unknown attributes"),
])
def test_graphcore_ctc_rejects_bad_attributes(attributes, message):
    targets, input_lengths, target_lengths = _hard_batch()
    with pytest.raises(poptorch.Error, match=message):
        poptorch.custom_op([_log_probs(), targets, input_lengths,
                            target_lengths], "Ctc", "ai.graphcore", 1,
                           example_outputs=[torch.zeros(())],
                           attributes=attributes)


def test_graphcore_ctc_mean_reduction():
    log_probs = _log_probs()
    targets, input_lengths, target_lengths = _hard_batch()
    loss, = poptorch.custom_op(
        [log_probs, targets, input_lengths, target_lengths], "Ctc",
        "ai.graphcore", 1, example_outputs=[torch.zeros(())],
        attributes={"zeroInfinity": 1})
    expected = F.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                          zero_infinity=True)
    assert math.isclose(loss.item(), expected.item(), abs_tol=ATOL)


@pytest.mark.parametrize("out_type, dtype", [("UNDEFINED", torch.float32),
                                             ("FLOAT", torch.float32),
                                             ("FLOAT16", torch.float16)])
def test_graphcore_ctc_out_data_type(out_type, dtype):
    log_probs = _log_probs()
    targets, input_lengths, target_lengths = _hard_batch()
    loss, = poptorch.custom_op(
        [log_probs, targets, input_lengths, target_lengths], "Ctc",
        "ai.graphcore", 1, example_outputs=[torch.zeros((), dtype=dtype)],
        attributes={"zeroInfinity": 1, "outDataType": out_type})
    expected = F.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                          zero_infinity=True)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, expected.to(dtype))

