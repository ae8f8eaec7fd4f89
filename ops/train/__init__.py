"""Training of the embedded models (CPU, seeded, from images that ship with scikit-image):
``sd`` (the default SD inpainting model), ``flux`` (the Flux Fill model); ``common`` holds what
the trainers share."""
