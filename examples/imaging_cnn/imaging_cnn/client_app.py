"""ClientApp of the imaging CNN example: one institution trains the CNN on its own scans."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from chaos_flwr.flower import enable  # chaos-flwr: 1 of 2 changed lines
from imaging_cnn.task import accuracy, fit, load_institution, load_test, make_model

torch.set_num_threads(1)

app = ClientApp()


def _model(msg: Message, context: Context) -> torch.nn.Module:
    cfg = context.run_config
    model = make_model(int(cfg["seed"]), int(cfg["hidden"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received CNN on this institution's images (FedProx's proximal-mu if sent)."""
    cfg, node = context.run_config, context.node_config
    model = _model(msg, context)
    partition = int(node["partition-id"])
    data = load_institution(
        partition, int(node["num-partitions"]), float(cfg["home-share"]), int(cfg["seed"])
    )
    server_round = int(msg.content["config"]["server-round"])
    loss = fit(
        model,
        data,
        {
            "epochs": int(cfg["local-epochs"]),
            "lr": float(cfg["lr"]),
            "batch_size": int(cfg["batch-size"]),
            "mu": float(msg.content["config"].get("proximal-mu", 0.0)),
            "seed": int(cfg["seed"]) * 7919 + server_round * 101 + partition,
        },
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(data[1])})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received CNN on the shared test images."""
    loss, acc = accuracy(_model(msg, context), load_test(int(context.run_config["seed"])))
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": 1})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


enable(app)  # chaos-flwr: 2 of 2 changed lines
