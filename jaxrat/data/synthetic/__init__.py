"""Small generated datasets in the official layouts (ISIC 2018, COCO 2017) for demos and tests."""
