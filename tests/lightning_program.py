"""A Lightning program run by test_lightning.py in its own process.

    lightning_program.py OUTPUT_FILE graphcore|builtin

It trains ``Classifier`` (a LightningModule whose steps call ``self.log``
and ``self.log_dict``) for ``EPOCHS`` epochs with Lightning's IPU strategy,
then validates and predicts, and saves to OUTPUT_FILE (``torch.save``) the
data, the initial and final weights, the metrics logged after each training
step, the metrics after ``fit``, ``validate``'s results and the predictions.
``graphcore`` uses lightning-graphcore's ``IPUAccelerator`` /
``IPUStrategy`` / ``IPUPrecision``, ``builtin`` Lightning 2.0's own
``accelerator="ipu"``. Run with ``POPTORCH_CPU_IS_IPU=1`` where no GPU is
present, as Lightning refuses to start without IPU hardware.
"""
import copy
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

SAMPLES = 32
BATCH = 8
EPOCHS = 2
LR = 0.1


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log_dict({"train_acc": (logits.argmax(1) == y).float().mean(),
                       "constant": 2.5})
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 4, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator))


class StepMetrics(pl.Callback):
    """The metrics Lightning holds after each training step."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.steps.append({name: value.clone() for name, value
                           in trainer.callback_metrics.items()})


def trainer_arguments(flavour: str) -> dict:
    if flavour == "builtin":
        return {"accelerator": "ipu"}
    from lightning_graphcore import IPUAccelerator, IPUPrecision, IPUStrategy
    return {"accelerator": IPUAccelerator(), "strategy": IPUStrategy(),
            "plugins": [IPUPrecision("32-true")]}


def main(output: str, flavour: str) -> None:
    torch.manual_seed(0)
    module = Classifier()
    initial = copy.deepcopy(module.state_dict())
    data = dataset()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    steps = StepMetrics()
    trainer = pl.Trainer(devices=1, max_epochs=EPOCHS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[steps],
                         **trainer_arguments(flavour))
    trainer.fit(module, loader, loader)
    fitted = dict(trainer.callback_metrics)
    validated = trainer.validate(module, loader, verbose=False)
    predictions = trainer.predict(module, loader)
    torch.save({"data": data.tensors, "initial": initial,
                "final": module.state_dict(), "steps": steps.steps,
                "fitted": fitted, "validated": validated,
                "predictions": predictions}, output)


if __name__ == "__main__":
    main(*sys.argv[1:])
