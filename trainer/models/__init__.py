"""Model pieces shared by tasks that are not tasks themselves: pretrained and LoRA loading (finetune), the
perceptual network (perceptual), the tokenizers' quantizers (quantize) and their GAN machinery (gan), the
feature CNN and its shipped digits weights (feature_cnn: FID/KID's and the decoders' digits image encoder)."""
