"""Attention on the vectorised replica path (``replication/attention.py``):
the replicas' attention is one batched computation (no per-replica loop,
no warning from vmap), with the results of plain PyTorch."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import poptorch
from conftest import assert_same_weights, options, reference_training


class OwnAttention(torch.nn.Module):
    """Calls F.scaled_dot_product_attention itself (causal)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, y=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        h = self.attention(q, k, v)
        out = self.out(h.transpose(1, 2).flatten(2).mean(1))
        if y is None:
            return out
        return out, F.cross_entropy(out, y)

    @staticmethod
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MaskedAttention(OwnAttention):
    """A boolean mask (True attends): each sample sees its first keys."""

    @staticmethod
    def attention(q, k, v):
        mask = (torch.arange(k.shape[2]) < 4).expand(q.shape[2], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class EncoderLayer(torch.nn.Module):
    """nn.TransformerEncoderLayer (attention inside
    F.multi_head_attention_forward) with a padding mask."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, y=None):
        mask = torch.zeros(x.shape[:2], dtype=torch.bool)
        mask[:, -2:] = True
        out = self.out(self.layer(x, src_key_padding_mask=mask)[:, 0])
        if y is None:
            return out
        return out, F.cross_entropy(out, y)


def _no_vmap_fallback(log):
    return "no vmap batching rule" not in log.text


@pytest.mark.parametrize("model_class",
                         [OwnAttention, MaskedAttention, EncoderLayer])
def test_replicas_train_attention_like_plain_pytorch(model_class,
                                                   poptorch_log):
    """R = 4, 2 device iterations: weights equal plain PyTorch's on the
    same micro-batches (atol 1e-6), and vmap never falls back to a loop."""
    torch.manual_seed(0)
    net = model_class()
    twin = copy.deepcopy(net)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, 8, generator=generator)
    y = torch.randint(0, 3, (16,), generator=generator)
    model = poptorch.trainingModel(
        net, options(device_iterations=2, replicas=4),
        torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y), device_iterations=2, replicas=4)
    assert _no_vmap_fallback(poptorch_log)
    assert_same_weights(net, twin, atol=1e-6)
    assert F.scaled_dot_product_attention is \
        torch._C._nn.scaled_dot_product_attention     # restored after tracing


def test_replicas_infer_attention_like_plain_pytorch(poptorch_log):
    torch.manual_seed(0)
    net = EncoderLayer().eval()
    x = torch.randn(8, 6, 8)
    out = poptorch.inferenceModel(net, options(replicas=2))(x)
    assert _no_vmap_fallback(poptorch_log)
    torch.testing.assert_close(out, net(x), atol=1e-6, rtol=0)


class _Divergence(torch.nn.Module):
    """F.kl_div, which has no vmap batching rule in torch 2.13."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, target):
        log_p = F.log_softmax(self.fc(x), dim=1)
        return log_p, F.kl_div(log_p, target, reduction="batchmean")


def test_an_operation_without_batching_rule_is_logged_not_warned(
        poptorch_log):
    """vmap's "performance drop" warning names a vmap the user did not
    write: the replicas' fallback is logged at INFO instead, and the
    results are plain PyTorch's."""
    torch.manual_seed(0)
    net = _Divergence()
    twin = copy.deepcopy(net)
    x = torch.randn(8, 4)
    target = torch.softmax(torch.randn(8, 3), dim=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = poptorch.trainingModel(net, options(replicas=2),
                                       torch.optim.SGD(net.parameters(),
                                                       lr=0.1))
        model(x, target)
    assert not [w for w in caught if "performance drop" in str(w.message)]
    assert "no vmap batching rule for aten::kl_div" in poptorch_log.text
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, target), replicas=2)
    assert_same_weights(net, twin, atol=1e-6)
