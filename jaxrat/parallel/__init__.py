"""Device meshes and the shardings of batches, parameters and optimizer state."""
