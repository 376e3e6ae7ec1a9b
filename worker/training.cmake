# Owned by the model work: the training model, data loading and tessera-worker.
