"""Model classes, not tasks: the autoencoders a task trains and another run loads frozen (autoencoder, vqgan,
video_tokenizer), MaskGIT's transformer (maskgit), the tokenizers' quantizers (quantize) and GAN machinery
(gan), the perceptual network (perceptual), pretrained and LoRA loading (finetune) and diffusers export
(export). The diffusion networks are the diffusion core's (trainer/diffusion/); the condition encoders,
classifier-free guidance and the digits feature CNN are conditioning's (trainer/conditioning/)."""
