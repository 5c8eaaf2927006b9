"""Model classes, not tasks: the autoencoders a task trains and another run loads frozen (autoencoder, vqgan,
video_tokenizer), MaskGIT's transformer (maskgit), the tokenizers' quantizers (quantize) and GAN machinery
(gan), the perceptual network (perceptual), the feature CNN and its shipped digits weights (feature_cnn: FID/KID's
and the decoders' digits image encoder), pretrained and LoRA loading (finetune) and diffusers export (export).
The diffusion networks are the diffusion core's (trainer/diffusion/)."""
