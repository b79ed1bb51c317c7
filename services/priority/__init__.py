"""The global waiting queue: admitted requests wait here until the batcher pulls the best ones."""
