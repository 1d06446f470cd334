"""The Kubernetes agent: the cluster agent's second implementation, behind the same
subject contract as the simulated cluster (docs/kubernetes.md).

Pure modules (no I/O, time passed in): labels, nodes, pods, gang, webhook, mig.
The edge: kube (the client library, its errors turned into ours), informer (list +
watch), lease (leader election), agent (the command handlers and reconcilers),
webhook_server, app (composition).
"""
