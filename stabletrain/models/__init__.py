"""Model families: ViT and Swin on timm, GPT in nanoGPT style."""
