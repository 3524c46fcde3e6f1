"""Config of the toy regression task (tests/toy/toy_regression.py)."""

from jaxrat.config_schema import base_config


def get_config(arg=None):
    c = base_config()
    c.task.name = "toy_regression:RegressionTask"
    c.data.batch_size = 16
    c.data.eval_batch_size = 16
    c.num_train_steps = 30
    c.optimizer.learning_rate = 0.1
    c.optimizer.warmup_steps = 2
    c.optimizer.weight_decay = 0.0
    c.train.log_every = 5
    c.train.eval_every = 10
    c.checkpoint.every_steps = 10
    c.checkpoint.best_metric = "eval/mse"
    c.checkpoint.best_mode = "min"
    return c
