"""Model pieces shared by tasks that are not tasks themselves (pretrained and LoRA loading, the perceptual network, ...)."""
