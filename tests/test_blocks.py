"""Block, BeginBlock, BlockFunction, removeBlocks and NameScope annotations
(API reference 11.5 and 11.3; guide "Multi-IPU execution strategies")."""
import copy
import io

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from poptorch._impl import blocks
from poptorch._impl.blocks import (BeginBlock, Block, BlockFunction,
                                   BlockRecord, NameScope, removeBlocks)
from poptorch.errors import Error

aten = torch.ops.aten


def capture(function, *args):
    """Trace like the executor does (a module's parameters become graph
    inputs); return the graph and the block records."""
    if isinstance(function, torch.nn.Module):
        module = function
        args = (dict(module.named_parameters()),) + args

        def function(parameters, *inputs):
            return torch.func.functional_call(module, parameters, inputs)

    blocks.begin_capture()
    try:
        with fx_traceback.preserve_node_meta():
            graph = make_fx(function, tracing_mode="fake")(*args)
    finally:
        records = blocks.end_capture()
    return graph, records


def custom_of(graph, target):
    """The ``custom`` metadata of the one node calling ``target``."""
    nodes = [n for n in graph.graph.nodes if n.target is target]
    assert len(nodes) == 1, f"expected one {target} node, found {len(nodes)}"
    return nodes[0].meta.get("custom") or {}


def block_of(graph, target):
    custom = custom_of(graph, target)
    return custom.get(blocks.BLOCK_KEY), custom.get(blocks.IPU_KEY)


class TwoStageModel(torch.nn.Module):
    def __init__(self, annotate: bool) -> None:
        super().__init__()
        self.annotate = annotate
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = torch.sin(x)
        with self._block("encoder", 0):
            x = torch.tanh(self.first(x))
        with self._block("decoder", 1):
            x = torch.exp(self.second(x))
        return x

    def _block(self, user_id, ipu_id):
        if self.annotate:
            return Block(user_id, ipu_id)
        return NameScope("unused")


def test_block_annotates_the_nodes_created_inside_it():
    graph, records = capture(TwoStageModel(annotate=True), torch.randn(3, 4))
    assert block_of(graph, aten.tanh.default) == ("encoder", 0)
    assert block_of(graph, aten.exp.default) == ("decoder", 1)
    assert block_of(graph, aten.sin.default) == (None, None)
    assert records == [BlockRecord("encoder", 0, 0),
                       BlockRecord("decoder", 1, 1)]


def test_annotations_do_not_change_what_the_model_computes():
    torch.manual_seed(0)
    annotated = TwoStageModel(annotate=True)
    plain = TwoStageModel(annotate=False)
    plain.load_state_dict(annotated.state_dict())
    x = torch.randn(5, 4)
    assert torch.equal(annotated(x), plain(x))
    BeginBlock(plain.first, "first", ipu_id=0)
    assert torch.equal(annotated(x), plain(x))


def test_blocks_outside_a_capture_are_harmless_even_when_nested():
    with Block("outer", ipu_id=0):
        with Block("inner", ipu_id=1):
            y = torch.ones(2) * 2
    assert torch.equal(y, torch.full((2,), 2.0))


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.cos(self.layer(x))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        x = torch.sin(x)
        x = self.encoder(x)
        x = torch.relu(x)
        return torch.exp(self.head(x))


def test_begin_block_annotates_the_module_and_its_submodules():
    model = Stack()
    assert BeginBlock(model.encoder, "enc", ipu_id=0) is model.encoder
    BeginBlock(model.head, "head", ipu_id=1)
    graph, records = capture(model, torch.randn(2, 3))
    linears = [n.meta["custom"][blocks.BLOCK_KEY] for n in graph.graph.nodes
               if n.target is aten.addmm.default]
    assert linears == ["enc", "head"]
    assert block_of(graph, aten.cos.default) == ("enc", 0)
    assert block_of(graph, aten.sin.default) == (None, None)
    assert [r.user_id for r in records] == ["enc", "head"]


def test_a_block_lasts_until_the_next_block_begins():
    model = Stack()
    BeginBlock(model.encoder, "enc", ipu_id=0)
    BeginBlock(model.head, "head", ipu_id=1)
    graph, _ = capture(model, torch.randn(2, 3))
    assert block_of(graph, aten.relu.default) == (None, None)
    blocks.propagate_block_annotations(graph.graph.nodes)
    assert block_of(graph, aten.relu.default) == ("enc", 0)
    assert block_of(graph, aten.sin.default) == (None, None)
    assert block_of(graph, aten.exp.default) == ("head", 1)


class WithFunctionBlock(torch.nn.Module):
    """A model whose second block begins with a function, as PopTorch
    allows: ``BeginBlock(function)`` returns a module calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = BeginBlock(Encoder(), user_id=0, ipu_id=0)
        self.squash = BeginBlock(torch.sigmoid, user_id=1, ipu_id=1)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.exp(self.head(self.squash(self.encoder(x))))


def test_begin_block_takes_a_function_and_an_integer_user_id():
    model = WithFunctionBlock()
    x = torch.randn(2, 3)
    expected = torch.exp(model.head(torch.sigmoid(model.encoder(x))))
    torch.testing.assert_close(model(x), expected)
    assert "BeginBlock(user_id='1', ipu_id=1), sigmoid" in repr(model)
    graph, records = capture(model, x)
    blocks.propagate_block_annotations(graph.graph.nodes)
    assert block_of(graph, aten.cos.default) == ("0", 0)
    assert block_of(graph, aten.sigmoid.default) == ("1", 1)
    assert block_of(graph, aten.exp.default) == ("1", 1)
    assert records == [BlockRecord("0", 0, 0), BlockRecord("1", 1, 1)]


def test_remove_blocks_removes_function_blocks_too():
    model = WithFunctionBlock()
    x = torch.randn(2, 3)
    expected = model(x)
    removeBlocks(model)
    assert "BeginBlock" not in repr(model)
    torch.testing.assert_close(model(x), expected)
    graph, records = capture(model, x)
    assert records == []
    assert block_of(graph, aten.sigmoid.default) == (None, None)


class Outer(torch.nn.Module):
    """A module whose middle layer is put in another block."""

    def __init__(self) -> None:
        super().__init__()
        self.before = torch.nn.Tanh()
        self.middle = torch.nn.Sigmoid()

    def forward(self, x):
        x = self.before(x)
        x = self.middle(x)
        return torch.cos(x)


def test_begin_block_inside_begin_block_takes_over_from_the_submodule_on():
    model = Outer()
    BeginBlock(model, "outer", ipu_id=0)
    BeginBlock(model.middle, "inner", ipu_id=1)
    graph, records = capture(model, torch.randn(2))
    blocks.propagate_block_annotations(graph.graph.nodes)
    assert block_of(graph, aten.tanh.default) == ("outer", 0)
    assert block_of(graph, aten.sigmoid.default) == ("inner", 1)
    assert block_of(graph, aten.cos.default) == ("inner", 1)
    assert [r.user_id for r in records] == ["outer", "inner"]


def test_a_block_module_called_again_begins_its_block_again():
    model = Stack()
    BeginBlock(model.encoder, "enc", ipu_id=0)
    BeginBlock(model.head, "head", ipu_id=1)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return torch.tanh(model.encoder(model.head(x)))

    graph, records = capture(Twice(), torch.randn(2, 3))
    blocks.propagate_block_annotations(graph.graph.nodes)
    assert block_of(graph, aten.tanh.default) == ("enc", 0)
    assert [r.user_id for r in records] == ["head", "enc"]


def test_begin_block_shows_in_repr_and_remove_blocks_undoes_it():
    model = Stack()
    plain_repr = repr(model)
    BeginBlock(model.encoder, "enc", ipu_id=1)
    assert "BeginBlock(user_id='enc', ipu_id=1)" in repr(model)
    removeBlocks(model)
    assert repr(model) == plain_repr
    graph, records = capture(model, torch.randn(2, 3))
    assert records == []
    assert block_of(graph, aten.cos.default) == (None, None)


@pytest.mark.parametrize("duplicate", [
    copy.deepcopy,
    lambda m: torch.load(_saved(m), weights_only=False),
], ids=["deepcopy", "pickle"])
def test_a_begin_block_module_can_be_copied_and_keeps_its_block(duplicate):
    model = Stack()
    BeginBlock(model.encoder, "enc", ipu_id=1)
    twin = duplicate(model)
    assert "BeginBlock(user_id='enc', ipu_id=1)" in repr(twin)
    graph, _ = capture(twin, torch.randn(2, 3))
    assert block_of(graph, aten.cos.default) == ("enc", 1)
    removeBlocks(twin)
    graph, _ = capture(twin, torch.randn(2, 3))
    assert block_of(graph, aten.cos.default) == (None, None)
    graph, _ = capture(model, torch.randn(2, 3))
    assert block_of(graph, aten.cos.default) == ("enc", 1)


def _saved(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


def test_begin_block_again_replaces_the_mark():
    model = Stack()
    BeginBlock(model.encoder, "first", ipu_id=0)
    BeginBlock(model.encoder, "second", ipu_id=1)
    graph, records = capture(model, torch.randn(2, 3))
    assert block_of(graph, aten.cos.default) == ("second", 1)
    assert records == [BlockRecord("second", 1, 0)]


class Decoding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    @BlockFunction("Decoder", ipu_id=1)
    def decoder(self, x):
        return torch.cos(self.layer(x))

    def forward(self, x):
        return torch.sin(self.decoder(torch.tanh(x)))


def test_block_function_annotates_a_method():
    model = Decoding()
    graph, records = capture(model, torch.randn(2, 3))
    assert block_of(graph, aten.cos.default) == ("Decoder", 1)
    assert block_of(graph, aten.tanh.default) == (None, None)
    assert records == [BlockRecord("Decoder", 1, 0)]
    assert Decoding.decoder.__name__ == "decoder"


def test_name_scopes_nest_with_slashes():
    def function(x):
        with NameScope("outer"):
            x = torch.sin(x)
            with NameScope("inner"):
                x = torch.cos(x)
            x = torch.tanh(x)
        return torch.exp(x)

    graph, _ = capture(function, torch.randn(2))
    key = blocks.NAME_SCOPE_KEY
    assert custom_of(graph, aten.sin.default)[key] == "outer"
    assert custom_of(graph, aten.cos.default)[key] == "outer/inner"
    assert custom_of(graph, aten.tanh.default)[key] == "outer"
    assert key not in custom_of(graph, aten.exp.default)


def test_name_scope_and_block_annotations_combine():
    def function(x):
        with NameScope("net"), Block("A", ipu_id=0):
            return torch.sin(x)

    graph, _ = capture(function, torch.randn(2))
    custom = custom_of(graph, aten.sin.default)
    assert custom[blocks.NAME_SCOPE_KEY] == "net"
    assert custom[blocks.BLOCK_KEY] == "A"


def test_f_string_ids_name_blocks_at_run_time():
    def function(x):
        for phase in range(3):
            with Block(f"phase{phase}_ipu{phase % 2}", ipu_id=phase % 2):
                x = torch.sin(x) if phase != 1 else torch.cos(x)
        return x

    graph, records = capture(function, torch.randn(2))
    assert [r.user_id for r in records] == ["phase0_ipu0", "phase1_ipu1",
                                            "phase2_ipu0"]
    assert block_of(graph, aten.cos.default) == ("phase1_ipu1", 1)


def test_use_auto_id_numbers_blocks_without_id_in_order():
    def function(x):
        Block.useAutoId()
        with Block():
            x = torch.sin(x)
        with Block("special_block"):
            x = torch.cos(x)
        with Block():
            x = torch.tanh(x)
        return x

    for _ in range(2):  # the numbering restarts for each capture
        graph, records = capture(function, torch.randn(2))
        assert [r.user_id for r in records] == ["0", "special_block", "1"]
        assert block_of(graph, aten.tanh.default) == ("1", None)


def test_blocks_without_id_are_numbered_from_zero_in_each_capture():
    model = Stack()
    BeginBlock(model.encoder, ipu_id=0)
    BeginBlock(model.head, ipu_id=1)
    model(torch.randn(2, 3))  # an eager run does not shift the numbering
    for _ in range(2):
        graph, records = capture(model, torch.randn(2, 3))
        assert records == [BlockRecord("0", 0, 0), BlockRecord("1", 1, 1)]
        assert block_of(graph, aten.cos.default) == ("0", 0)


def test_a_block_module_without_id_called_twice_is_one_block():
    model = Stack()
    BeginBlock(model.head, ipu_id=0)

    _, records = capture(torch.nn.Sequential(model.head, model.head),
                         torch.randn(2, 3))
    assert records == [BlockRecord("0", 0, 0)]


def test_a_block_inside_another_block_scope_is_an_error_during_capture():
    def function(x):
        with Block("outer", ipu_id=0):
            x = torch.sin(x)
            with Block("inner", ipu_id=1):
                return torch.cos(x)

    with pytest.raises(Error, match="'inner' begins inside Block 'outer'"):
        capture(function, torch.randn(2))
    graph, _ = capture(lambda x: torch.tanh(x), torch.randn(2))
    assert custom_of(graph, aten.tanh.default) == {}


def test_a_block_module_inside_a_block_function_is_an_error():
    model = Encoder()
    BeginBlock(model, "enc", ipu_id=1)

    @BlockFunction("function", ipu_id=0)
    def function(x):
        return model(x)

    with pytest.raises(Error, match="BeginBlock 'enc' begins inside "
                                    "BlockFunction 'function'"):
        capture(function, torch.randn(2, 3))


def test_a_closed_block_scope_also_refuses_blocks_nested_deeper():
    class Inner(torch.nn.Module):
        def forward(self, x):
            with Block("B", ipu_id=1):
                return torch.cos(x)

    model = BeginBlock(Inner(), "A", ipu_id=0)
    _, records = capture(model, torch.randn(2))
    assert [r.user_id for r in records] == ["A", "B"]

    def function(x):
        with Block("A", ipu_id=0):
            return model(x)

    with pytest.raises(Error, match="Block 'B' begins inside Block 'A'"):
        capture(function, torch.randn(2))


def test_reentering_the_same_block_inside_itself_is_allowed():
    def function(x):
        with Block("A", ipu_id=0):
            with Block("A"):
                return torch.sin(x)

    graph, records = capture(function, torch.randn(2))
    assert records == [BlockRecord("A", 0, 0)]


def test_one_block_id_on_two_ipus_is_an_error():
    def function(x):
        with Block("A", ipu_id=0):
            x = torch.sin(x)
        with Block("A", ipu_id=1):
            return torch.cos(x)

    with pytest.raises(Error, match="Block 'A' is placed on IPU 0 and again "
                                    "on IPU 1"):
        capture(function, torch.randn(2))


def test_a_block_repeated_without_ipu_keeps_the_ipu_given_once():
    def function(x):
        with Block("A"):
            x = torch.sin(x)
        with Block("A", ipu_id=2):
            return torch.cos(x)

    _, records = capture(function, torch.randn(2))
    assert records == [BlockRecord("A", 2, 0)]


def test_an_exception_in_a_block_module_closes_its_block():
    class Failing(torch.nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    failing = BeginBlock(Failing(), "fail", ipu_id=0)
    with pytest.raises(ValueError):
        failing(torch.ones(1))
    graph, _ = capture(lambda x: torch.sin(x), torch.randn(2))
    assert custom_of(graph, aten.sin.default) == {}


@pytest.mark.parametrize("make, message", [
    (lambda: Block(user_id=1.5), "Block: user_id must be a string .*, an "
                                 "integer or None, not float 1.5"),
    (lambda: Block(user_id=True), "Block: user_id must be a string"),
    (lambda: Block(ipu_id=-1), "Block: ipu_id must be a non-negative"),
    (lambda: Block(ipu_id=1.5), "Block: ipu_id must be a non-negative"),
    (lambda: BeginBlock(3), "BeginBlock: layer_to_call must be a "
                            "torch.nn.Module or a function, not int"),
    (lambda: BeginBlock(torch.nn.ReLU(), ipu_id=True),
     "BeginBlock: ipu_id must be"),
    (lambda: BlockFunction(ipu_id="x"), "BlockFunction: ipu_id must be"),
    (lambda: BlockFunction("A")(3), "BlockFunction decorates functions"),
    (lambda: removeBlocks("model"), "removeBlocks: module must be"),
    (lambda: NameScope(""), "NameScope: name must be a non-empty string"),
])
def test_bad_annotation_arguments_raise_clear_errors(make, message):
    with pytest.raises(Error, match=message):
        make()


def test_an_ipu_id_written_as_a_string_is_accepted():
    def function(x):
        with Block("A", ipu_id="1"):
            return torch.sin(x)

    _, records = capture(function, torch.randn(2))
    assert records == [BlockRecord("A", 1, 0)]


def test_block_start_begins_a_block_lasting_until_the_next_one():
    """The keys ``Block.start`` gives last until the enclosing scope closes
    (here a name scope); propagation extends the block from there."""
    def function(x):
        x = torch.sin(x)
        Block.start("A", ipu_id=0)
        x = torch.cos(x)
        with NameScope("inner"):
            Block.start("B", ipu_id=1)
            x = torch.tanh(x)
        return torch.exp(x)

    graph, records = capture(function, torch.randn(2))
    assert records == [BlockRecord("A", 0, 0), BlockRecord("B", 1, 1)]
    assert block_of(graph, aten.cos.default) == ("A", 0)
    assert block_of(graph, aten.tanh.default) == ("B", 1)
    assert block_of(graph, aten.exp.default) == ("A", 0)
    blocks.propagate_block_annotations(graph.graph.nodes)
    assert block_of(graph, aten.sin.default) == (None, None)
    assert block_of(graph, aten.exp.default) == ("B", 1)
    assert "custom" not in fx_traceback.current_meta


def test_block_start_takes_automatic_ids_and_integer_ids():
    def function(x):
        Block.useAutoId()
        Block.start()
        x = torch.sin(x)
        with Block():
            x = torch.cos(x)
        Block.start(7, ipu_id=1)
        return torch.tanh(x)

    graph, records = capture(function, torch.randn(2))
    assert [r.user_id for r in records] == ["0", "1", "7"]
    assert block_of(graph, aten.tanh.default) == ("7", 1)


def test_block_start_inside_another_block_scope_is_an_error():
    def function(x):
        with Block("A"):
            Block.start("B")
            return torch.sin(x)

    with pytest.raises(Error, match="Block.start 'B' begins inside Block "
                                    "'A'"):
        capture(function, torch.randn(2))


def test_block_start_outside_a_capture_does_nothing():
    Block.start("A", ipu_id=0)
    assert "custom" not in fx_traceback.current_meta
    _, records = capture(torch.sin, torch.randn(2))
    assert records == []
    with pytest.raises(Error, match="Block.start: ipu_id must be"):
        Block.start("A", ipu_id=-1)
