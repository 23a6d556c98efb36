"""The bundled model's trainer, its corpus and its tasks."""
