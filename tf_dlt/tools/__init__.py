"""The `tf-dlt` command line and the operator tools behind it: `launch`
(shards and trainers on one machine), `k8s` (Kubernetes manifests),
`capacity` (`tf-dlt plan`) and `cluster_stats` (`tf-dlt stats`). Nothing in
the core package or the Keras features imports this one."""
