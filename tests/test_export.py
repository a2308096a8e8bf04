"""Precompilation: compileAndExport / save write a file that poptorch.load
(with the model) or loadExecutable (into a re-created model) restore, with
identical results; files that do not fit raise poptorch.Error saying why."""
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import poptorch
from conftest import BatchNormNet, make_images, options

TESTS = os.path.dirname(os.path.abspath(__file__))


class DropoutNet(torch.nn.Module):
    """Random numbers in training: dropout."""

    def __init__(self, hidden=8, activation=torch.relu):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, hidden)
        self.fc2 = torch.nn.Linear(hidden, 3)
        self.activation = activation

    def forward(self, x, y):
        h = torch.nn.functional.dropout(self.activation(self.fc1(x)), 0.3)
        out = self.fc2(h)
        return out, torch.nn.functional.cross_entropy(out, y)


def _data(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def _inference(seed=0, **option_calls):
    torch.manual_seed(seed)
    net = BatchNormNet().eval()
    return poptorch.inferenceModel(net, options(2, **option_calls))


def _training(seed=0, hidden=8, activation=torch.relu, optimizer=None):
    torch.manual_seed(seed)
    net = DropoutNet(hidden, activation)
    opts = options(2).randomSeed(7)
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=0.1,
                                             momentum=0.9)
    return poptorch.trainingModel(net, opts, optimizer)


def _rewrite(path, replace):
    """Rewrite the zip at ``path``, replacing members per ``replace``."""
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members.update(replace)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_load_restores_an_inference_model(tmp_path):
    path = tmp_path / "model.poptorch"
    model = _inference()
    x, y = make_images(4)
    model.compileAndExport(path, x, y)
    loaded = poptorch.load(path)
    assert loaded.isCompiled()
    assert loaded.model is not model.model
    for expected, got in zip(model(x, y), loaded(x, y)):
        assert torch.equal(expected, got)
    assert loaded.getTensorNames() == model.getTensorNames()


class WithConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])


def test_graph_constants_are_stored_as_tensors(tmp_path):
    path = tmp_path / "constant.poptorch"
    torch.manual_seed(0)
    model = poptorch.inferenceModel(WithConstant())
    x = torch.randn(2, 3)
    model.compileAndExport(path, x, export_model=False)
    with zipfile.ZipFile(path) as archive:
        tensors = torch.load(archive.open("tensors.pt"), weights_only=True)
        graph = json.loads(archive.read("graphs/inference.json"))
    assert torch.equal(tensors["constants/inference/_tensor_constant0"],
                       torch.tensor([1.0, 2.0, 3.0]))
    assert any(node["op"] == "get_attr" for node in graph["nodes"])
    torch.manual_seed(0)
    fresh = poptorch.inferenceModel(WithConstant())
    fresh.loadExecutable(path)
    assert torch.equal(fresh(x), model(x))


def test_load_restores_training_state_and_random_numbers(tmp_path):
    path = tmp_path / "training.poptorch"
    model = _training()
    for call in range(2):
        model(*_data(4, seed=call))
    model.save(path)
    loaded = poptorch.load(path)
    for call in range(2, 5):
        data = _data(4, seed=call)
        expected, got = model(*data), loaded(*data)
        assert torch.equal(expected[0], got[0])
        assert torch.equal(expected[1], got[1])
    model.copyWeightsToHost()
    loaded.copyWeightsToHost()
    for name, value in model.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name


@pytest.mark.parametrize("method", ["compileAndExport", "save"])
def test_a_training_and_a_validation_model_of_one_module_load_back(
        tmp_path, method):
    """The spec's precompilation example: the module is put in eval mode
    for the validation model after the training model wraps it. Each file
    keeps the modes its model runs with (the training file used to load
    the module in eval mode and refuse its own executable)."""
    torch.manual_seed(0)
    net = BatchNormNet()
    training = poptorch.trainingModel(net, options())
    net.eval()
    validation = poptorch.inferenceModel(net, options())
    x, y = make_images(4)
    paths = tmp_path / "training.poptorch", tmp_path / "validation.poptorch"
    if method == "save":
        training(x, y)
        validation(x, y)
        training.save(paths[0])
        validation.save(paths[1])
    else:
        training.compileAndExport(paths[0], x, y)
        validation.compileAndExport(paths[1], x, y)
    loaded_training, loaded_validation = (poptorch.load(p) for p in paths)
    # Validation first: the next training call changes net's weights.
    torch.testing.assert_close(loaded_validation(x, y), validation(x, y))
    torch.testing.assert_close(loaded_training(x, y), training(x, y))


def test_a_pickled_training_model_keeps_its_modes(tmp_path):
    """``torch.save`` of the wrapper after ``module.eval()``: the loaded
    wrapper still trains in train mode, as the original does."""
    torch.manual_seed(0)
    net = BatchNormNet()
    training = poptorch.trainingModel(net, options())
    net.eval()
    x, y = make_images(4)
    training(x, y)
    torch.save(training, tmp_path / "wrapper.pt")
    loaded = torch.load(tmp_path / "wrapper.pt", weights_only=False)
    torch.testing.assert_close(loaded(x, y), training(x, y))


def test_without_rng_state_the_seed_restarts(tmp_path):
    path = tmp_path / "training.poptorch"
    model = _training()
    model(*_data(4))
    model.save(path, save_rng_state=False)
    manifest = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    assert manifest["rng_seed"] is None
    loaded = poptorch.load(path)
    assert loaded.rng_state[0] == 7


def test_load_executable_into_a_re_created_model(tmp_path):
    path = tmp_path / "exe.poptorch"
    model = _inference()
    x, y = make_images(4)
    model.compileAndExport(path, x, y, export_model=False)
    names = zipfile.ZipFile(path).namelist()
    assert "model.pt" not in names
    assert not any(name.startswith("executables/") for name in names)
    fresh = _inference()
    fresh.loadExecutable(path)
    assert fresh.isCompiled()
    for expected, got in zip(model(x, y), fresh(x, y)):
        assert torch.equal(expected, got)
    with pytest.raises(poptorch.Error, match="export_model=False: it holds "
                       "no model"):
        poptorch.load(path)


def test_load_executable_reads_no_pickle(tmp_path):
    """loadExecutable works when the pickled model is unreadable; only
    poptorch.load reads it."""
    path = tmp_path / "model.poptorch"
    model = _inference()
    x, y = make_images(4)
    model.compileAndExport(path, x, y)
    _rewrite(path, {"model.pt": b"not a pickle"})
    fresh = _inference()
    fresh.loadExecutable(path)
    assert torch.equal(fresh(x, y)[0], model(x, y)[0])
    with pytest.raises(poptorch.Error, match="model cannot be unpickled"):
        poptorch.load(path)


def test_never_connected_model_exports_and_loads_to_run(tmp_path):
    path = tmp_path / "offline.poptorch"
    x, y = make_images(4)
    offline = _inference(useOfflineIpuTarget=2)
    offline.compileAndExport(path, x, y)
    with pytest.raises(poptorch.Error, match=r"created with "
                       r"useOfflineIpuTarget\(\), which sets "
                       r"connectionType\(ConnectionType.Never\)"):
        offline(x, y)
    loaded = poptorch.load(path)
    online = _inference()
    assert torch.equal(loaded(x, y)[0], online(x, y)[0])


def test_edit_opts_fn_changes_runtime_options_only(tmp_path):
    path = tmp_path / "model.poptorch"
    model = _inference()
    x, y = make_images(4)
    model.compileAndExport(path, x, y)

    def edit(opts):
        opts.showCompilationProgressBar(False)
        opts.deviceIterations(7)

    loaded = poptorch.load(path, edit_opts_fn=edit)
    assert loaded.options.show_compilation_progress_bar is False
    assert loaded.options.device_iterations == 2
    assert torch.equal(loaded(x, y)[0], model(x, y)[0])


def _exported(tmp_path, model, *args, export_model=False):
    path = tmp_path / "exported.poptorch"
    model.compileAndExport(path, *args, export_model=export_model)
    return path


@pytest.mark.parametrize("make_other,message", [
    (lambda: _training(hidden=9),
     r"the model's parameters differ: exported fc1.weight \(8, 4\) "
     r"float32, now fc1.weight \(9, 4\) float32"),
    (lambda: _training(activation=torch.tanh),
     "its update step differs from the exported one at operation"),
    (lambda: poptorch.trainingModel(DropoutNet(), options(2).randomSeed(7)),
     "the optimizer differs from the exported one"),
    (lambda: poptorch.trainingModel(DropoutNet(), options(3).randomSeed(7)),
     "the option device_iterations was 2 when the file was exported and "
     "is 3 now"),
    (lambda: poptorch.inferenceModel(DropoutNet(), options(2)),
     "it holds a training model, not an inference model"),
])
def test_load_executable_names_what_differs(tmp_path, make_other, message):
    path = _exported(tmp_path, _training(), *_data(4))
    other = make_other()
    with pytest.raises(poptorch.Error, match=message):
        other.loadExecutable(path)
    assert not other.isCompiled()


def test_a_file_from_another_version_is_refused(tmp_path):
    path = _exported(tmp_path, _inference(), *make_images(4))
    manifest = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    manifest["poptorch_version"] = "0.0.1"
    _rewrite(path, {"manifest.json": json.dumps(manifest).encode()})
    with pytest.raises(poptorch.Error, match=r"was exported by poptorch "
                       r"0\.0\.1 .* The versions must match exactly"):
        _inference().loadExecutable(path)


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path = _exported(tmp_path, _inference(), *make_images(4))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(poptorch.Error, match="truncated or corrupted"):
        _inference().loadExecutable(path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(poptorch.Error, match="is not a PopTorch executable "
                       "file"):
        poptorch.load(text)
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("data.txt", "x")
    with pytest.raises(poptorch.Error, match="has no manifest.json"):
        _inference().loadExecutable(other_zip)
    with pytest.raises(poptorch.Error, match="no such file"):
        poptorch.load(tmp_path / "missing.poptorch")


def test_loaded_model_checks_its_input_signature(tmp_path):
    path = _exported(tmp_path, _inference(), *make_images(4))
    fresh = _inference()
    fresh.loadExecutable(path)
    with pytest.raises(poptorch.Error, match="Argument 'x' changed after "
                       "compilation"):
        fresh(*make_images(6))


def test_save_needs_a_compiled_model_and_load_a_fresh_one(tmp_path):
    model = _inference()
    with pytest.raises(poptorch.Error, match="save: the model is not "
                       "compiled yet"):
        model.save(tmp_path / "x.poptorch")
    path = _exported(tmp_path, model, *make_images(4))
    with pytest.raises(poptorch.Error, match="already compiled"):
        model.loadExecutable(path)


def test_exporting_to_a_directory_is_an_error_naming_it(tmp_path):
    model = _inference()
    quoted = re.escape(repr(str(tmp_path)))
    with pytest.raises(poptorch.Error, match=f"compileAndExport: {quoted} "
                       "is a directory"):
        model.compileAndExport(str(tmp_path), *make_images(4))
    assert not model.isCompiled()
    model.compile(*make_images(4))
    with pytest.raises(poptorch.Error, match=f"save: {quoted} is a "
                       "directory"):
        model.save(tmp_path)
    assert os.listdir(tmp_path) == []


def test_writing_leaves_no_temporary_files(tmp_path):
    _exported(tmp_path, _inference(), *make_images(4))
    assert sorted(os.listdir(tmp_path)) == ["exported.poptorch"]


_CHILD = '''
import sys, torch
sys.path.insert(0, {tests!r})
import poptorch
from poptorch._impl.backends import inductor
if {forbid_compile}:
    from torch._inductor import cpp_builder
    build = cpp_builder.CppBuilder.build

    def refuse(*args, **kwargs):
        raise AssertionError("compiled instead of loading the executable")

    def build_no_library(builder):
        if builder.get_target_file_path().endswith(".so"):
            refuse()
        return build(builder)
    inductor.InductorBackend.compile = refuse
    cpp_builder.CppBuilder.build = build_no_library
model = poptorch.load({path!r})
x, y = torch.load({data!r})
torch.save(model(x, y), {result!r})
'''


def _load_in_new_process(tmp_path, path, data, forbid_compile=False):
    data_path, result = tmp_path / "data.pt", tmp_path / "result.pt"
    torch.save(data, data_path)
    code = _CHILD.format(tests=TESTS, path=str(path), data=str(data_path),
                         result=str(result), forbid_compile=forbid_compile)
    environment = {**os.environ, "POPTORCH_CACHE_DIR": "",
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                   env=environment)
    return torch.load(result)


@pytest.mark.slow
def test_load_in_a_new_process_gives_identical_outputs(tmp_path):
    path = tmp_path / "model.poptorch"
    model = _inference()
    x, y = make_images(4)
    model.compileAndExport(path, x, y)
    outputs = _load_in_new_process(tmp_path, path, (x, y))
    for expected, got in zip(model(x, y), outputs):
        assert torch.equal(expected, got)


@pytest.mark.slow
def test_inductor_executable_loads_in_a_new_process_without_compiling(
        tmp_path):
    """The new process has an empty Inductor cache: the file carries the
    compiled kernels, so neither the graph nor a kernel is compiled."""
    path = tmp_path / "model.poptorch"
    model = _inference(setBackend="inductor")
    x, y = make_images(4)
    model.compileAndExport(path, x, y)
    names = zipfile.ZipFile(path).namelist()
    assert "executables/inference.bin" in names
    outputs = _load_in_new_process(tmp_path, path, (x, y),
                                   forbid_compile=True)
    for expected, got in zip(model(x, y), outputs):
        torch.testing.assert_close(got, expected)
