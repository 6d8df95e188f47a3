"""The shared ground the stages stand on: errors, hashes, files, images, sources, remote storage, devices."""
