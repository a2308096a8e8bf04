"""nn.Transformer and nn.TransformerEncoder captured on their regular path
(no fast path, no nested tensors, no causal-mask detection reading the
mask), in inference and training, against plain PyTorch."""
import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import assert_same_weights, options, reference_training

E, HEADS, FEEDFORWARD, SEQUENCE, CLASSES = 8, 2, 16, 5, 3
# Encoder configurations: (enable_nested_tensor, norm_first, batch_first,
# causal mask). With the defaults, eager PyTorch in evaluation without
# gradients converts the padded batch to nested tensors.
CONFIGURATIONS = {
    "nested": (True, False, True, False),
    "not-nested": (False, False, True, False),
    "norm-first": (True, True, True, False),
    "sequence-first": (True, False, False, False),
    "causal-mask": (True, False, True, True),
}


def _configurations(*fast):
    """The configurations' names, those not in ``fast`` marked slow."""
    return [name if name in fast else
            pytest.param(name, marks=pytest.mark.slow)
            for name in CONFIGURATIONS]


def _padding(batch, seed):
    """A left-aligned key padding mask (True where padded), every sequence
    at least one step long."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, SEQUENCE + 1, (batch, 1), generator=generator)
    return torch.arange(SEQUENCE) >= lengths


def _data(batch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, SEQUENCE, E, generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    return x, _padding(batch, seed), y


class Encoder(torch.nn.Module):
    """A one-layer encoder over a padded batch, its outputs pooled over the
    unpadded steps into a classifier when labels are given."""

    def __init__(self, nested, norm_first, batch_first, causal):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(
            E, HEADS, FEEDFORWARD, dropout=0.0, batch_first=batch_first,
            norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(
            layer, 1, norm=torch.nn.LayerNorm(E), enable_nested_tensor=nested)
        self.head = torch.nn.Linear(E, CLASSES)
        self.batch_first = batch_first
        self.causal = causal

    def forward(self, x, padding, y=None):
        mask = (torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool,
                           device=x.device).triu(1)
                if self.causal else None)
        h = self.encoder(x if self.batch_first else x.transpose(0, 1),
                         mask=mask, src_key_padding_mask=padding)
        h = h if self.batch_first else h.transpose(0, 1)
        if y is None:
            return h
        kept = (~padding).unsqueeze(-1).to(h.dtype)
        out = self.head((h * kept).sum(1) / kept.sum(1))
        return out, F.cross_entropy(out, y)


def _encoder(name):
    torch.manual_seed(0)
    return Encoder(*CONFIGURATIONS[name])


def _per_micro_batch(model, count, *inputs):
    return torch.cat([model(*parts) for parts in zip(
        *[t.unflatten(0, (count, -1)) for t in inputs])])


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_encoder_inference_matches_pytorch(name):
    model = _encoder(name).eval()
    x, padding, _ = _data(8)
    wrapper = poptorch.inferenceModel(
        model, options(device_iterations=2, replicas=2))
    captured = wrapper(x, padding)
    assert compiled_model(wrapper).engine.replicas.path == "vectorised"
    regular = _per_micro_batch(model, 4, x, padding)
    with torch.no_grad():
        fast = _per_micro_batch(model, 4, x, padding)
    torch.testing.assert_close(captured, regular, atol=1e-5, rtol=1e-5)
    kept = ~padding
    torch.testing.assert_close(captured[kept], fast[kept], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("name", _configurations("causal-mask"))
def test_encoder_training_matches_pytorch(name):
    model = _encoder(name)
    reference = copy.deepcopy(model)
    x, padding, y = _data(16)
    opts = options(device_iterations=2, accumulation=2, replicas=2,
                   outputMode=poptorch.OutputMode.All)
    wrapper = poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = wrapper(x, padding, y)
    expected = reference_training(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1),
        (x, padding, y), device_iterations=2, accumulation=2, replicas=2)
    torch.testing.assert_close(loss.flatten(), expected, atol=1e-5,
                               rtol=1e-5)
    assert_same_weights(model, reference, atol=1e-5)


class Translator(torch.nn.Module):
    """nn.Transformer with a causal target mask (detected by PyTorch from
    its values) and padded sources, classifying each target step."""

    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.Transformer(
            E, HEADS, 1, 1, FEEDFORWARD, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(E, CLASSES)

    def forward(self, source, target, padding, y=None):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(
            target.shape[1], device=target.device)
        h = self.transformer(source, target, tgt_mask=causal,
                             src_key_padding_mask=padding,
                             memory_key_padding_mask=padding)
        out = self.head(h)
        if y is None:
            return out
        return out, F.cross_entropy(out.flatten(0, 1), y.flatten())


def _translation(batch):
    generator = torch.Generator().manual_seed(1)
    source, padding, _ = _data(batch)
    target = torch.randn(batch, 4, E, generator=generator)
    y = torch.randint(0, CLASSES, (batch, 4), generator=generator)
    return source, target, padding, y


def test_transformer_inference_matches_pytorch():
    torch.manual_seed(0)
    model = Translator().eval()
    source, target, padding, _ = _translation(8)
    wrapper = poptorch.inferenceModel(
        model, options(device_iterations=2, replicas=2))
    captured = wrapper(source, target, padding)
    assert compiled_model(wrapper).engine.replicas.path == "vectorised"
    with torch.no_grad():
        fast = _per_micro_batch(model, 4, source, target, padding)
    regular = _per_micro_batch(model, 4, source, target, padding)
    torch.testing.assert_close(captured, fast, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(captured, regular, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_transformer_training_matches_pytorch():
    torch.manual_seed(0)
    model = Translator()
    reference = copy.deepcopy(model)
    inputs = _translation(16)
    opts = options(device_iterations=2, accumulation=2, replicas=2,
                   outputMode=poptorch.OutputMode.All)
    wrapper = poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _, loss = wrapper(*inputs)
    expected = reference_training(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1,
                                   momentum=0.9), inputs,
        device_iterations=2, accumulation=2, replicas=2)
    torch.testing.assert_close(loss.flatten(), expected, atol=1e-5,
                               rtol=1e-5)
    assert_same_weights(model, reference, atol=1e-5)


def test_capture_leaves_pytorch_settings_as_they_were():
    model = _encoder("causal-mask").eval()
    x, padding, _ = _data(2)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    detect = torch.nn.modules.transformer._detect_is_causal_mask
    poptorch.inferenceModel(model)(x, padding)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert torch.nn.modules.transformer._detect_is_causal_mask is detect
