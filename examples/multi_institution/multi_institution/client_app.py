"""ClientApp of the multi-institution example: one institution training on its own slice."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from chaos_flwr.flower import enable  # chaos-flwr: 1 of 2 changed lines
from multi_institution.task import evaluate, load_partition, make_model, train

torch.set_num_threads(1)

app = ClientApp()


def _setup(msg: Message, context: Context) -> tuple[torch.nn.Module, tuple[object, object]]:
    cfg = context.run_config
    model = make_model(int(cfg["seed"]), int(cfg["hidden"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_partition(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        float(cfg["dirichlet-alpha"]),
        int(cfg["seed"]),
    )
    return model, data


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on this institution's slice for a few local epochs."""
    model, (train_data, _) = _setup(msg, context)
    cfg = context.run_config
    server_round = int(msg.content["config"]["server-round"])
    partition = int(context.node_config["partition-id"])
    loss = train(
        model,
        train_data,  # type: ignore[arg-type]
        epochs=int(cfg["local-epochs"]),
        lr=float(cfg["lr"]),
        batch_size=int(cfg["batch-size"]),
        seed=int(cfg["seed"]) * 100_003 + server_round * 1009 + partition,
        proximal_mu=float(msg.content["config"].get("proximal-mu", 0.0)),
    )
    n = len(train_data[1])  # type: ignore[index]
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": n}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this institution's held-out slice."""
    model, (_, val_data) = _setup(msg, context)
    loss, acc = evaluate(model, val_data)  # type: ignore[arg-type]
    n = len(val_data[1])  # type: ignore[index]
    content = RecordDict(
        {"metrics": MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": n})}
    )
    return Message(content=content, reply_to=msg)


enable(app)  # chaos-flwr: 2 of 2 changed lines
