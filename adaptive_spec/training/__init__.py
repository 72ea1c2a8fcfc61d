"""Training acceptance heads (`adaptive-spec train`, train.py) and the offline replay that turns a
head into a threshold curve (`adaptive-spec autotune`)."""
