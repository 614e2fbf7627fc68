"""Model-level Keras features on top of `tf_dlt.layers`: walking a model's
tables (`walk`), saving and loading them with the dense weights
(`checkpoint`), SavedModel export (`export`), recovery from lost shards
(`recovery`), trainer metrics (`client_metrics`) and dense weights on the
shards (`dense_sync`). The core package never imports this one; the public
names are `tf_dlt.save`, `tf_dlt.load`, `tf_dlt.ModelCheckpoint`,
`tf_dlt.export_saved_model`, `tf_dlt.resilient_fit`, `tf_dlt.ClientMetrics`,
`tf_dlt.DenseOnShards`."""
