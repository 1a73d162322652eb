use candle_core::{DType, Device, Tensor};
use sdhive_models::*;
fn md(a:&Tensor,b:&Tensor)->f32{ assert_eq!(a.dims(),b.dims()); (a.to_dtype(DType::F32).unwrap()-b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() }
#[test]
fn adhoc() {
    let d=Device::Cpu; let f=std::path::Path::new("/work/main/tests/fixtures/models");
    let g=candle_core::safetensors::load("/tmp/sdref/odd.safetensors",&d).unwrap();
    let u=UNet2DConditionModel::from_dir(&f.join("sd1/unet"),DType::F32,&d).unwrap();
    eprintln!("odd sd1 {}", md(&u.forward(&g["s1"],999.0,&g["c1"],None).unwrap(),&g["o1"]));
    let u=UNet2DConditionModel::from_dir(&f.join("sdxl/unet"),DType::F32,&d).unwrap();
    let add=SdxlConditioning{text_embeds:g["te"].clone(),time_ids:g["ti"].clone()};
    eprintln!("odd sdxl {}", md(&u.forward(&g["s2"],0.0,&g["c2"],Some(&add)).unwrap(),&g["o2"]));
    let v=AutoencoderKL::from_dir(&f.join("sd1/vae"),DType::F32,&d).unwrap();
    let m=v.encode(&g["img"]).unwrap().mean; eprintln!("vae enc {}", md(&m,&g["vm"]));
    eprintln!("vae dec {}", md(&v.decode(&g["vm"]).unwrap(),&g["vd"]));
    for dt in [DType::F16, DType::BF16] {
        let u=UNet2DConditionModel::from_dir(&f.join("sdxl/unet"),dt,&d).unwrap();
        eprintln!("{dt:?} sdxl unet {}", md(&u.forward(&g["s2"],0.0,&g["c2"],Some(&add)).unwrap(),&g["o2"]));
        let v=AutoencoderKL::from_dir(&f.join("sd1/vae"),dt,&d).unwrap();
        eprintln!("{dt:?} vae dec {}", md(&v.decode(&g["vm"]).unwrap(),&g["vd"]));
        let c=ClipTextModel::from_dir(&f.join("sdxl/text_encoder_2"),true,dt,&d).unwrap();
        let o=c.forward(&Tensor::new(&[[1512u32,5,6,1513,0,0]],&d).unwrap()).unwrap();
        eprintln!("{dt:?} clip ok {:?}", o.text_embeds.unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()[0][..3].to_vec());
    }
}
