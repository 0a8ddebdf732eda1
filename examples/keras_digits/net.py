"""A Keras Sequential CNN for scikit-learn's digits (8x8 images, one channel first, as
examples/digits gives them), the same shape as examples/digits/net.py. phalanx imports this module
with KERAS_BACKEND=torch."""

from __future__ import annotations

import keras


def cnn(channels: int = 32, hidden: int = 128, dropout: float = 0.2) -> keras.Sequential:
    """Two convolutions and a pooling, then a hidden layer and ten class scores (logits)."""
    first = {"padding": "same", "activation": "relu", "data_format": "channels_first"}
    return keras.Sequential(
        [
            keras.Input((1, 8, 8)),
            keras.layers.Conv2D(channels, 3, **first),
            keras.layers.Conv2D(2 * channels, 3, **first),
            keras.layers.MaxPooling2D(2, data_format="channels_first"),
            keras.layers.Flatten(),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(10),
        ],
        name="digits_cnn",
    )
