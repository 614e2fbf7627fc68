"""What a distributed table takes from the Keras objects users already hold.

- Keras initializers become the table's per-id deterministic initializers
  (a row's start is a pure function of (seed, id), so the values differ from
  what Keras would draw, but the distribution is the same): RandomNormal,
  RandomUniform, TruncatedNormal, Zeros, Ones and Constant with their
  arguments and seed; with `input_dim` also VarianceScaling and its Glorot,
  He and Lecun forms (their scale needs the table's shape).
- A compiled Keras optimizer becomes the table's server-side optimizer with
  the same hyper-parameters: SGD (with momentum and Nesterov too), Adagrad,
  Adam and AdamW (without amsgrad) and Ftrl (without beta and l2
  shrinkage), with their decoupled `weight_decay`; momentum, Adam and weight
  decay are lazy (applied to the rows a push touches, see docs/keras.md).
  Each push carries the optimizer's current learning rate (a schedule
  evaluated at its iterations).
- Local tables take Keras initializers as they are; a `tf_dlt.initializers`
  object becomes its Keras equivalent.
"""

from __future__ import annotations

import math
import re
from typing import Any

import keras
import tensorflow as tf

from tf_dlt import initializers, optimizers

INITIALIZERS_SUPPORTED = (
    "RandomNormal, RandomUniform, TruncatedNormal, Zeros, Ones, Constant (names too: "
    '"uniform", "normal", ...), and with input_dim VarianceScaling, GlorotNormal, '
    "GlorotUniform, HeNormal, HeUniform, LecunNormal, LecunUniform"
)
OPTIMIZERS_SUPPORTED = (
    "SGD (with or without momentum and Nesterov), Adagrad, Adam and AdamW (no amsgrad), Ftrl "
    "(no beta, no l2 shrinkage); weight_decay with any of them"
)
# keras.initializers.VarianceScaling: stddev of a normal truncated at 2 stddev.
_TRUNCATED_STDDEV = 0.87962566103423978


def table_initializer(
    identifier: Any, input_dim: int | None, output_dim: int
) -> tuple[initializers.Initializer, int | None]:
    """(the table's initializer, the Keras initializer's seed or None) for
    a Keras initializer (object, name or config) or a `tf_dlt.initializers`
    one."""
    if isinstance(identifier, initializers.Initializer):
        return identifier, None
    if isinstance(identifier, dict) and "kind" in identifier:
        return initializers.get(identifier), None
    try:
        init = keras.initializers.get(identifier)
    except ValueError:
        init = None
    if init is None:
        raise ValueError(
            f"embeddings_initializer {identifier!r} is not a Keras or tf_dlt initializer; "
            f"distributed tables take {INITIALIZERS_SUPPORTED}"
        )
    seed = init.get_config().get("seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    k = keras.initializers
    if isinstance(init, k.Zeros):
        return initializers.Zeros(), seed
    if isinstance(init, k.Ones):
        return initializers.Constant(1.0), seed
    if isinstance(init, k.Constant):
        return initializers.Constant(float(init.value)), seed
    if isinstance(init, k.RandomUniform):
        return initializers.RandomUniform(float(init.minval), float(init.maxval)), seed
    if isinstance(init, k.TruncatedNormal):
        return initializers.TruncatedNormal(float(init.mean), float(init.stddev)), seed
    if isinstance(init, k.RandomNormal):
        return initializers.RandomNormal(float(init.mean), float(init.stddev)), seed
    if isinstance(init, k.VarianceScaling):
        if input_dim is None:
            raise ValueError(
                f"{type(init).__name__} scales with the table's shape: give the layer input_dim "
                "(the vocabulary size it is computed from), or use another initializer "
                f"({INITIALIZERS_SUPPORTED})"
            )
        return _variance_scaling(init, input_dim, output_dim), seed
    raise ValueError(
        f"{type(init).__name__} cannot initialize a distributed table row by row; "
        f"distributed tables take {INITIALIZERS_SUPPORTED}"
    )


def _variance_scaling(init: Any, fan_in: int, fan_out: int) -> initializers.Initializer:
    """keras.initializers.VarianceScaling for a (fan_in, fan_out) matrix."""
    scale = float(init.scale)
    if init.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif init.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    if init.distribution == "truncated_normal":
        return initializers.TruncatedNormal(0.0, math.sqrt(scale) / _TRUNCATED_STDDEV)
    if init.distribution == "untruncated_normal":
        return initializers.RandomNormal(0.0, math.sqrt(scale))
    limit = math.sqrt(3.0 * scale)
    return initializers.RandomUniform(-limit, limit)


def keras_initializer(identifier: Any) -> Any:
    """What a local table's `add_weight` takes: Keras initializers as they
    are, `tf_dlt.initializers` objects as their Keras equivalents."""
    if isinstance(identifier, dict) and "kind" in identifier:
        identifier = initializers.get(identifier)
    if not isinstance(identifier, initializers.Initializer):
        return keras.initializers.get(identifier)
    k = keras.initializers
    if isinstance(identifier, initializers.Zeros):
        return k.Zeros()
    if isinstance(identifier, initializers.Constant):
        return k.Constant(identifier.value)
    if isinstance(identifier, initializers.RandomUniform):
        return k.RandomUniform(identifier.minval, identifier.maxval)
    if isinstance(identifier, initializers.TruncatedNormal):
        return k.TruncatedNormal(identifier.mean, identifier.stddev)
    if isinstance(identifier, initializers.RandomNormal):
        return k.RandomNormal(identifier.mean, identifier.stddev)
    raise ValueError(f"no Keras initializer for {identifier!r}")


def inner(optimizer: Any) -> Any:
    """The optimizer doing the updates (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def table_optimizer(optimizer: Any, layer: Any = None) -> optimizers.Optimizer:
    """The server-side optimizer with the hyper-parameters of a Keras one;
    ValueError naming what is supported otherwise. `layer`: the Embedding
    whose table it is (its anchor and name are checked against the
    optimizer's `exclude_from_weight_decay`)."""
    opt = inner(optimizer)
    server_side = getattr(opt, "table_config", None)  # tf_dlt.DenseOnShards
    if server_side is not None:
        return server_side.optimizer  # type: ignore[no-any-return]
    name = type(opt).__name__
    for option in ("clipnorm", "clipvalue", "global_clipnorm"):
        if getattr(opt, option, None):
            raise ValueError(
                f"the model's {name} has {option}={getattr(opt, option)!r}, which a table's "
                "server-side optimizer does not apply: give the tf_dlt Embedding layer its own "
                "optimizer= (and learning_rate=) to train the table without it"
            )
    if getattr(opt, "use_ema", False):
        raise ValueError(
            f"the model's {name} keeps an exponential moving average (use_ema), which tables "
            "do not: give the tf_dlt Embedding layer its own optimizer="
        )
    decay = {"weight_decay": _weight_decay(opt, layer)}
    k = keras.optimizers
    if type(opt) is k.SGD:
        if opt.momentum:
            return optimizers.Momentum(
                momentum=float(opt.momentum), nesterov=bool(opt.nesterov), **decay
            )
        return optimizers.SGD(**decay)  # Keras ignores nesterov without momentum
    if type(opt) is k.Adagrad:
        return optimizers.KerasAdagrad(
            initial_accumulator=float(opt.initial_accumulator_value),
            epsilon=float(opt.epsilon),
            **decay,
        )
    if type(opt) in (k.Adam, k.AdamW) and not opt.amsgrad:
        return optimizers.Adam(
            beta1=float(opt.beta_1), beta2=float(opt.beta_2), epsilon=float(opt.epsilon), **decay
        )
    if type(opt) is k.Ftrl and not opt.l2_shrinkage_regularization_strength and not float(opt.beta):
        return optimizers.Ftrl(
            learning_rate_power=float(opt.learning_rate_power),
            l1=float(opt.l1_regularization_strength),
            l2=float(opt.l2_regularization_strength),
            initial_accumulator=float(opt.initial_accumulator_value),
            **decay,
        )
    followed = (k.SGD, k.Adagrad, k.Adam, k.AdamW, k.Ftrl)
    why = _options(opt) if type(opt) in followed else "a class tables do not follow"
    raise ValueError(
        f"a distributed table cannot follow the model's {name} "
        f"({why}); tables follow {OPTIMIZERS_SUPPORTED}. Give the tf_dlt Embedding "
        "layer its own optimizer= and learning_rate= (a tf_dlt.optimizers name or object)"
    )


def _weight_decay(opt: Any, layer: Any) -> float:
    """The optimizer's decoupled weight decay for `layer`'s table: 0 when it
    has none or excludes the layer (`exclude_from_weight_decay` with its
    anchor variable, or a name pattern matching the layer or table name)."""
    decay = float(getattr(opt, "weight_decay", None) or 0.0)
    if not decay or layer is None:
        return decay
    anchor = getattr(layer, "anchor", None)
    if anchor is not None and not opt._use_weight_decay(anchor):
        return 0.0
    pattern = getattr(opt, "_exclude_from_weight_decay_pattern", None)
    names = (layer.name, getattr(layer, "table_name", layer.name))
    if pattern is not None and any(re.search(pattern, n) for n in names):
        return 0.0
    return decay


def _options(opt: Any) -> str:
    keys = ("momentum", "nesterov", "amsgrad", "beta", "l2_shrinkage_regularization_strength")
    return ", ".join(f"{k}={getattr(opt, k)!r}" for k in keys if hasattr(opt, k))


def current_learning_rate(optimizer: Any) -> tf.Tensor:
    """The learning rate a Keras optimizer applies now (a schedule evaluated
    at its iterations), as a float32 tensor."""
    return tf.cast(tf.convert_to_tensor(inner(optimizer).learning_rate), tf.float32)
