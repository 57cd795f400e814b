"""Job-wide logs for ``fit`` and ``evaluate``: the numbers of one process on all the data.

Keras computes each metric from state variables that add up over batches:
a total and a count for ``Mean`` and every ``MeanMetricWrapper`` (the loss,
accuracy, ...), confusion counts for ``AUC``/``Precision``/``Recall``, sums for
``R2Score``. Summing those variables over the ranks and then calling
``result()`` gives the metric over every rank's data, each row counted once:
a weighted reduction, right for uneven shards, where a mean of per-rank
results is not (rank 0 with 3 rows and loss 1.0, rank 1 with 1 row and loss
0.0: the job's loss is 0.75, the mean of rank means 0.5).

:func:`install` puts this in front of Keras's ``Trainer._get_metrics_result_or_logs``
on one model, the single place where ``fit`` makes each epoch's logs (train
part, then the validation part through ``evaluate``) and ``evaluate`` makes
its result, before any callback sees them. So every callback, wherever it is
in the list, sees the same numbers on every rank and decides the same way.
Per-batch logs stay each rank's own (no communication per step).

A custom ``train_step``/``test_step`` that returns its metrics' results, also
nested as the Keras guides write it (``{m.name: m.result() for m in
self.metrics}``, where ``compile_metrics`` is a dict), gets the job's results
the same way. If it returns other keys, Keras uses those logs; their scalar
values are then averaged over the ranks (Horovod's ``MetricAverageCallback``
rule).

A custom ``keras.metrics.Metric`` whose state is not a sum (a running maximum,
say) would be summed too: give such a metric no state, or compute it after
:func:`hvdkit.data.unshard`.
"""

from __future__ import annotations

import keras
import numpy as np

from .. import collectives, runtime
from ..errors import ConfigurationError

# Keras 3's Trainer method that returns each epoch's and each evaluate's logs
KERAS_LOGS_HOOK = "_get_metrics_result_or_logs"


def _metric_variables(model) -> list:
    """Every state variable of the model's metrics, once each, in a fixed order."""
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _numpy(value):
    array = np.asarray(keras.ops.convert_to_numpy(value))
    return float(array) if array.ndim == 0 else array


def flatten_logs(logs: dict) -> dict:
    """``logs`` with nested dicts merged into the top level, as Keras flattens them.

    A custom ``train_step`` that returns ``{m.name: m.result() for m in self.metrics}``
    (the Keras guides' pattern) returns ``{"loss": x, "compile_metrics": {"mae": y}}``.
    """
    flat = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[key] = value
    return flat


def average_scalar_logs(logs: dict, what: str) -> dict:
    """``logs`` with every scalar replaced by its mean over the ranks (same keys needed)."""
    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
    names = collectives.allgather_object(keys, name=f"hvdkit.{what}.keys")
    if any(n != keys for n in names):
        raise ConfigurationError(
            f"{what}: ranks report different metrics {names}; compile the same metrics on "
            "every rank (and return the same keys from a custom train_step/test_step)."
        )
    if not keys:
        return dict(logs)
    values = np.array([float(_numpy(logs[k])) for k in keys], dtype=np.float64)
    averaged = collectives.allreduce(values, op=collectives.Average, name=f"hvdkit.{what}")
    return {**logs, **dict(zip(keys, map(float, averaged), strict=True))}


def _job_results_or_logs(model, keras_method, logs):
    """Keras's method, on metric states summed over the ranks; restores the local states."""
    variables = _metric_variables(model)
    local = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    if variables:
        summed = collectives.grouped_allreduce(
            local, op=collectives.Sum, name="hvdkit.metric_state"
        )
        for v, s in zip(variables, summed, strict=True):
            v.assign(s)
    try:
        out = keras_method(logs)
        if out is logs:  # a custom step's own logs
            flat = flatten_logs(dict(logs or {}))
            job = model.get_metrics_result()  # on the summed states
            # its metrics' results, nested (the Keras guides' pattern): the job's results;
            # anything else is the step's own numbers: average them
            out = job if set(flat) == set(job) else average_scalar_logs(flat, "metric_logs")
        out = {k: _numpy(v) for k, v in out.items()}
        hook = vars(model).get(KERAS_LOGS_HOOK)
        if hook is not None:
            hook.keys |= set(out)
        return out
    finally:
        for v, value in zip(variables, local, strict=True):
            v.assign(value)


def install(model) -> None:
    """From now on ``model``'s epoch and evaluate logs are the job's (nested calls count)."""
    if runtime.size() == 1:
        return
    own = vars(model)
    hook = own.get(KERAS_LOGS_HOOK)
    if hook is not None:
        hook.depth += 1
        return
    keras_method = getattr(model, KERAS_LOGS_HOOK, None)
    if keras_method is None:
        raise ConfigurationError(
            f"this Keras ({keras.__version__}) has no Model.{KERAS_LOGS_HOOK}, where hvdkit "
            "makes fit's and evaluate's logs job-wide; use the Keras version hvdkit pins "
            "(see README)."
        )

    def job_results_or_logs(logs):
        return _job_results_or_logs(model, keras_method, logs)

    job_results_or_logs.depth = 1
    job_results_or_logs.keys = set()  # the log keys made job-wide so far
    own[KERAS_LOGS_HOOK] = job_results_or_logs  # this model only; Keras's class is untouched


def remove(model) -> None:
    """Undo one :func:`install`; the last one gives ``model`` Keras's own logs back."""
    own = vars(model)
    hook = own.get(KERAS_LOGS_HOOK)
    if hook is None:
        return
    hook.depth -= 1
    if hook.depth == 0:
        del own[KERAS_LOGS_HOOK]


def job_keys(model) -> set[str]:
    """Log keys already made job-wide on ``model`` (``val_`` forms included)."""
    hook = vars(model).get(KERAS_LOGS_HOOK)
    keys = set() if hook is None else hook.keys
    return keys | {f"val_{k}" for k in keys}
