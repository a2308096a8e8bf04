"""The executable cache: a compiled step is stored under a key covering
everything that changes it and loaded by later compilations, in this
process or another; unusable entries are compiled again, never trusted.

The fast tests use a counting backend whose executables are the graph in
the JSON graph format, so they see every compilation and load; the slow
ones use Inductor in two processes."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
from poptorch._impl.backends import backend as backend_module
from poptorch._impl.backends import vector_isa
from poptorch._impl.graph_format import deserialize_graph, serialize_graph
from conftest import BatchNormNet, make_images, options

TESTS = os.path.dirname(os.path.abspath(__file__))


class CountingBackend(backend_module.Backend):
    """Runs the captured graph; its executable is the graph as JSON."""
    name = "counting"
    keeps_executables = True

    def __init__(self):
        self.compiles = 0
        self.loads = 0
        self.refuse_loads = False
        self.settings = ""

    def settings_fingerprint(self):
        return self.settings

    def compile(self, graph, example_inputs, donation=None):
        self.compiles += 1
        return graph

    def serialize(self, step, portable=False):
        return json.dumps(serialize_graph(step)[0]).encode()

    def deserialize(self, data):
        self.loads += 1
        if self.refuse_loads:
            raise RuntimeError("this executable is refused")
        return deserialize_graph(json.loads(data), {})


@pytest.fixture
def counting(monkeypatch):
    backend = CountingBackend()
    monkeypatch.setitem(backend_module._BACKENDS, backend.name, backend)
    monkeypatch.delenv("POPTORCH_CACHE_DIR", raising=False)
    return backend


def _model(cache_dir, device_iterations=2, seed=0, lr=0.1, popart=None):
    torch.manual_seed(seed)
    net = BatchNormNet()
    opts = options(device_iterations).setBackend("counting")
    for key, value in (popart or {}).items():
        opts._Popart.set(key, value)
    if cache_dir is not None:
        opts.enableExecutableCaching(str(cache_dir))
    return poptorch.trainingModel(net, opts,
                                  torch.optim.SGD(net.parameters(), lr=lr))


def _reference(device_iterations=2, seed=0, lr=0.1):
    torch.manual_seed(seed)
    net = BatchNormNet()
    opts = options(device_iterations).setBackend("graph")
    return poptorch.trainingModel(net, opts,
                                  torch.optim.SGD(net.parameters(), lr=lr))


def _entries(cache_dir):
    return sorted(name for name in os.listdir(cache_dir)
                  if name.endswith(".pexe"))


def _losses(model, calls=2, rows=4):
    return torch.stack([model(*make_images(rows, seed=call))[1]
                        for call in range(calls)])


def test_second_compilation_loads_the_stored_step(counting, tmp_path):
    first = _losses(_model(tmp_path))
    assert counting.compiles == 1 and counting.loads == 0
    assert len(_entries(tmp_path)) == 1
    second = _losses(_model(tmp_path))
    assert counting.compiles == 1 and counting.loads == 1
    assert torch.equal(first, second)
    assert torch.equal(second, _losses(_reference()))


def test_the_backends_own_settings_are_part_of_the_key(counting, tmp_path):
    counting.settings = "cpp_wrapper=False"
    _losses(_model(tmp_path))
    counting.settings = "cpp_wrapper=True"
    _losses(_model(tmp_path))
    assert counting.compiles == 2 and counting.loads == 0
    assert len(_entries(tmp_path)) == 2
    counting.settings = "cpp_wrapper=False"
    _losses(_model(tmp_path))
    assert counting.compiles == 2 and counting.loads == 1


def test_weights_and_hyper_parameters_are_inputs_not_part_of_the_key(
        counting, tmp_path):
    _losses(_model(tmp_path))
    other = _model(tmp_path, seed=3, lr=0.5)
    losses = _losses(other)
    assert counting.compiles == 1 and counting.loads == 1
    assert torch.equal(losses, _losses(_reference(seed=3, lr=0.5)))


def test_popart_options_without_effect_are_not_part_of_the_key(
        counting, tmp_path):
    _losses(_model(tmp_path))
    _losses(_model(tmp_path, popart={"outlineThreshold": 10.0}))
    assert counting.compiles == 1 and counting.loads == 1


@pytest.mark.parametrize("change", ["options", "input shape"])
def test_what_changes_the_executable_changes_the_key(counting, tmp_path,
                                                     change):
    _losses(_model(tmp_path))
    if change == "options":
        _losses(_model(tmp_path, device_iterations=1), rows=2)
    else:
        _losses(_model(tmp_path), rows=8)
    assert counting.compiles == 2 and counting.loads == 0
    assert len(_entries(tmp_path)) == 2


def _damage(cache_dir, damage):
    entry = os.path.join(cache_dir, _entries(cache_dir)[0])
    with open(entry, "rb") as stream:
        data = stream.read()
    with open(entry, "wb") as stream:
        stream.write(damage(data))
    return entry


@pytest.mark.parametrize("damage,reason", [
    (lambda data: data[:len(data) - 10], "is truncated"),
    (lambda data: data[:-5] + bytes(5), "is corrupted (checksum mismatch)"),
    (lambda data: b"garbage\n" + data, "has no valid header"),
    (lambda data: b"", "has no valid header"),
])
def test_a_damaged_entry_is_compiled_again_and_replaced(
        counting, tmp_path, poptorch_log, damage, reason):
    expected = _losses(_model(tmp_path))
    entry = _damage(tmp_path, damage)
    assert torch.equal(_losses(_model(tmp_path)), expected)
    assert counting.compiles == 2 and counting.loads == 0
    warnings = [r.getMessage() for r in poptorch_log.records
                if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert entry in warnings[0] and reason in warnings[0]
    assert "compiling again" in warnings[0]
    _losses(_model(tmp_path))
    assert counting.compiles == 2 and counting.loads == 1


def test_an_entry_the_backend_refuses_is_compiled_again(
        counting, tmp_path, poptorch_log):
    expected = _losses(_model(tmp_path))
    counting.refuse_loads = True
    assert torch.equal(_losses(_model(tmp_path)), expected)
    assert counting.compiles == 2
    assert any("this executable is refused" in r.getMessage()
               for r in poptorch_log.records)


def test_entries_are_written_whole(counting, tmp_path):
    _losses(_model(tmp_path))
    names = os.listdir(tmp_path)
    assert not [name for name in names if name.startswith(".tmp-")]
    with open(tmp_path / _entries(tmp_path)[0], "rb") as stream:
        header = json.loads(stream.readline())
        payload = stream.read()
    assert header["magic"] == "poptorch-executable-cache"
    assert header["size"] == len(payload)


def test_environment_variable_and_disabling(counting, tmp_path,
                                            monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    _losses(_model(None))
    assert len(_entries(tmp_path)) == 1
    disabled = poptorch.trainingModel(
        BatchNormNet(), options(2).setBackend("counting")
        .enableExecutableCaching(None))
    _losses(disabled)
    _losses(_model(None))
    assert counting.compiles == 2 and counting.loads == 1


def test_an_unwritable_cache_only_warns(counting, tmp_path, poptorch_log):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    losses = _losses(_model(blocker))
    assert torch.equal(losses, _losses(_reference()))
    assert any("Could not write the executable cache entry" in
               r.getMessage() for r in poptorch_log.records)


def test_graph_backend_compiles_nothing_to_cache(tmp_path):
    torch.manual_seed(0)
    opts = options(2).setBackend("graph").enableExecutableCaching(
        str(tmp_path))
    model = poptorch.inferenceModel(BatchNormNet().eval(), opts)
    model(*make_images(4))
    assert os.listdir(tmp_path) == []


def test_load_takes_executables_from_the_file(counting, tmp_path):
    path = tmp_path / "model.poptorch"
    model = _model(None)
    x, y = make_images(4)
    model.compileAndExport(path, x, y)
    assert counting.compiles == 1
    loaded = poptorch.load(path)
    assert counting.compiles == 1 and counting.loads == 1
    assert torch.equal(loaded(x, y)[1], model(x, y)[1])


def test_load_executable_compiles_through_the_cache(counting, tmp_path):
    path = tmp_path / "exe.poptorch"
    cache = tmp_path / "cache"
    model = _model(cache)
    x, y = make_images(4)
    model.compileAndExport(path, x, y, export_model=False)
    fresh = _model(cache)
    fresh.loadExecutable(path)
    assert counting.compiles == 1 and counting.loads == 1
    uncached = _model(None)
    uncached.loadExecutable(path)
    assert counting.compiles == 2
    expected = model(x, y)[1]
    for other in (fresh, uncached):
        assert torch.equal(other(x, y)[1], expected)


_CHILD = '''
import sys, time, torch
sys.path.insert(0, {tests!r})
import poptorch
from poptorch._impl.backends import inductor
from conftest import BatchNormNet, make_images, options
from torch._inductor import cpu_vec_isa
if {forbid_compile}:
    def refuse(*args, **kwargs):
        raise AssertionError("compiled instead of using the cache")
    inductor.InductorBackend.compile = refuse
if {forbid_probe}:
    probe = cpu_vec_isa.VecISA.check_build
    def no_probe(isa, code):
        if code == cpu_vec_isa.VecISA._avx_code:
            raise AssertionError("probed the vector instruction sets again")
        return probe(isa, code)
    cpu_vec_isa.VecISA.check_build = no_probe
torch.manual_seed(0)
opts = options(2).setBackend("inductor").enableExecutableCaching({cache!r})
net = BatchNormNet()
model = poptorch.trainingModel(net, opts,
                               torch.optim.SGD(net.parameters(), lr=0.1))
losses = [model(*make_images(4, seed=call))[1] for call in range(2)]
torch.save(torch.stack(losses), {result!r})
'''


def _run_child(tmp_path, forbid_compile, forbid_probe=False):
    result = tmp_path / "losses.pt"
    code = _CHILD.format(tests=TESTS, cache=str(tmp_path / "cache"),
                         result=str(result), forbid_compile=forbid_compile,
                         forbid_probe=forbid_probe)
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True)
    return torch.load(result)


@pytest.mark.slow
def test_a_second_process_loads_inductor_steps_from_the_cache(tmp_path):
    """... without compiling, and without Inductor's probe of each of the
    CPU's vector instruction sets where the first process recorded that
    they all passed (``backends/vector_isa.py``)."""
    first = _run_child(tmp_path, forbid_compile=False)
    record = tmp_path / "cache" / "inductor" / vector_isa.RECORD
    if vector_isa.machine() is not None:
        assert record.exists() == _all_sets_passed()
    second = _run_child(tmp_path, forbid_compile=True,
                        forbid_probe=record.exists())
    assert torch.equal(first, second)
    torch.testing.assert_close(second, _losses(_reference()), atol=1e-5,
                               rtol=1e-4)


def _all_sets_passed() -> bool:
    """Whether Inductor's probe passes every instruction set the CPU
    reports (probing in this process)."""
    from torch._inductor import cpu_vec_isa
    cpu_vec_isa.valid_vec_isa_list()
    return vector_isa.all_checks_passed(vector_isa.machine())


@pytest.fixture
def isa_machine():
    current = vector_isa.machine()
    if current is None:
        pytest.skip("Inductor probes instruction sets on x86-64 Linux only")
    return current


def test_a_recorded_check_of_this_machine_is_trusted(tmp_path, isa_machine):
    from torch._inductor import config
    (tmp_path / vector_isa.RECORD).write_text(json.dumps(isa_machine))
    with vector_isa.remembered_check(str(tmp_path)):
        assert config.cpp.vec_isa_ok is True
    assert config.cpp.vec_isa_ok is None


def test_a_record_of_another_machine_is_not_trusted(tmp_path, isa_machine):
    from torch._inductor import config
    other = dict(isa_machine, cpu=isa_machine["cpu"] + ["avx10"])
    (tmp_path / vector_isa.RECORD).write_text(json.dumps(other))
    with vector_isa.remembered_check(str(tmp_path)):
        assert config.cpp.vec_isa_ok is None


@pytest.mark.slow
def test_a_process_that_probed_records_the_outcome(tmp_path, isa_machine):
    from torch._inductor import cpu_vec_isa
    with vector_isa.remembered_check(str(tmp_path)):
        cpu_vec_isa.valid_vec_isa_list()
    record = tmp_path / vector_isa.RECORD
    assert record.exists() == _all_sets_passed()
    if record.exists():
        assert json.loads(record.read_text()) == isa_machine
