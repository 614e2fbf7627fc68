"""Checkpoint files, shared by the shard servers (which write and read their
shard files) and the clients (which commit a checkpoint with its manifest):
`manifest` (MANIFEST.json, save ids, which files a save supersedes) and
`shard_files` (one shard's HDF5 file: save, verify, stage for load). Imports
no TensorFlow and nothing of the server process."""
